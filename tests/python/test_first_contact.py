"""What a new user meets first: one exception hierarchy under StashError, the
client's settings through a public call, a Stash and an OffloadAdamW that a `with`
block closes (the daemon sees the session end and the pool given back), and a plan
that answers before the first step."""
import copy
import datetime

import pytest
import torch

import actstash
from actstash._plan import _selective
from actstash.optim import OffloadAdamW
from conftest import pool_stats
from gpt import GPT, loss_fn


def test_every_error_of_the_package_is_a_stash_error():
    for name in ("StashUnavailable", "StashFull", "StashNotFound", "StashInvalidArgument",
                 "BudgetError"):
        assert issubclass(getattr(actstash, name), actstash.StashError), name
    # A budget is an argument the caller can change: still a ValueError.
    assert issubclass(actstash.BudgetError, ValueError)
    from actstash._plan import _planner
    assert _planner.BudgetError is actstash.BudgetError
    with pytest.raises(actstash.StashError):  # what the planner raises is caught as one
        _planner.solve([_planner.BlockCost("b", forward_s=0.01, backward_s=0.02,
                                           saved_bytes=1 << 20, input_bytes=1 << 20)],
                       _planner.Machine(store_bps=1e9, fetch_bps=1e9), budget=1)


def test_a_value_the_daemon_side_refuses_is_a_stash_error_and_a_value_error(fresh_daemon):
    """INVALID_ARGUMENT from the native library (an unknown setting, a bad size) raises
    StashInvalidArgument: caught as a StashError and, like Python's checks, a ValueError."""
    for bad in ({"no_such_setting": 1}, {"lease_batch": "lots"}):
        with pytest.raises(actstash.StashInvalidArgument) as raised:
            actstash.connect(fresh_daemon.socket, **bad)
        assert isinstance(raised.value, actstash.StashError)
        assert isinstance(raised.value, ValueError)
        assert next(iter(bad)) in str(raised.value)


def test_client_defaults_are_public_and_a_copy():
    defaults = actstash.client_defaults()
    assert "client_defaults" in actstash.__all__ and "client_defaults" in dir(actstash)
    for name in ("spill", "restore_ahead", "pool_wait_ms", "lease_retain_ms", "lease_batch"):
        assert name in defaults, name
    defaults["spill"] = "changed"
    assert actstash.client_defaults()["spill"] != "changed"


def test_durations_are_seconds_or_a_timedelta(fresh_daemon):
    """One unit per kind: connect's durations without a unit in their name are seconds
    (or a datetime.timedelta, as torch.distributed takes them)."""
    with actstash.connect(fresh_daemon.socket, timeout=datetime.timedelta(seconds=7),
                          connect_timeout=2.5) as stash:
        assert stash.client.stats()["pool"]["total_bytes"] > 0
    for bad in (0, -1, "30", float("nan"), True, datetime.timedelta(0)):
        with pytest.raises(ValueError, match="seconds or a datetime.timedelta"):
            actstash.connect(fresh_daemon.socket, timeout=bad)
    with pytest.raises(ValueError, match="connect_timeout"):
        actstash.connect(fresh_daemon.socket, connect_timeout="5s")


def test_checkpoint_keeps_small_inputs_as_offload_and_wrap_do(fresh_daemon):
    """checkpoint()'s min_bytes defaults to the 64 KiB of Stash.offload and wrap: a
    boundary input below it stays in the trainer, one above it goes to the daemon."""
    with actstash.connect(fresh_daemon.socket) as stash:
        def block(t):
            return torch.tanh(t) * 2
        for side, offloaded in ((64, False), (256, True)):  # 16 KiB, 256 KiB of fp32
            before = stash.stats()["tensors_offloaded"]
            x = torch.randn(side, side, requires_grad=True)
            y = actstash.checkpoint(block, x * 1, stash=stash)
            assert (stash.stats()["tensors_offloaded"] > before) == offloaded, side
            y.sum().backward()
            plain = x.detach().clone().requires_grad_()
            block(plain * 1).sum().backward()
            assert torch.equal(x.grad, plain.grad), side


def test_a_with_block_closes_the_stash(fresh_daemon):
    before = pool_stats(fresh_daemon.socket)["sessions"]
    with actstash.connect(fresh_daemon.socket) as stash:
        assert stash.client.attached
        assert pool_stats(fresh_daemon.socket)["sessions"] == before + 1
        x = torch.randn(256, 256, requires_grad=True)
        with stash.offload(min_bytes=0):
            y = (x * x).sum()
        y.backward()
        stats = stash.stats()
        assert stats["tensors_offloaded"] > 0  # it really went to the daemon
        assert stats["daemon_pid"] == fresh_daemon.proc.pid  # and which daemon that is
        assert stats["daemon_version"] == stash.client.stats()["daemon_version"] != ""
    assert pool_stats(fresh_daemon.socket)["sessions"] == before
    assert torch.equal(x.grad, 2 * x.detach())


def test_a_with_block_closes_the_optimizer_and_it_goes_on_bitwise(fresh_daemon):
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, heads=2, layers=1, context=16, dropout=0.0)
    plain = copy.deepcopy(model)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=False)
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    with actstash.connect(fresh_daemon.socket) as stash:
        with OffloadAdamW(model.parameters(), stash=stash, lr=1e-3) as opt:
            assert opt.offloaded_bytes > 0
            assert stash.client.stats()["pool"]["used_bytes"] >= opt.offloaded_bytes
            for m, o in ((plain, reference), (model, opt)):
                loss_fn(m, idx).backward()
                o.step()
        # Closed: the states are the process's own and the pool holds nothing of them.
        assert stash.stats()["optimizer_state_bytes"] == 0
        for m, o in ((plain, reference), (model, opt)):  # it goes on working
            o.zero_grad()
            loss_fn(m, idx).backward()
            o.step()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_offload_adamw_takes_torchs_arguments_and_the_processs_session(
        fresh_daemon, monkeypatch):
    """OffloadAdamW(params, lr, ...) as torch.optim.AdamW: without stash= it uses the
    process's own session (connect() with its defaults: here ACTSTASH_ADDRESS); the
    states are in that daemon's pool, and the steps are bitwise torch's."""
    from actstash._connect import _connect
    monkeypatch.setenv("ACTSTASH_ADDRESS", fresh_daemon.socket)
    monkeypatch.setattr(_connect, "_process_stash", None)
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, heads=2, layers=1, context=16, dropout=0.0)
    plain = copy.deepcopy(model)
    reference = torch.optim.AdamW(plain.parameters(), 3e-3, (0.9, 0.99), foreach=False)
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    opt = OffloadAdamW(model.parameters(), 3e-3, (0.9, 0.99))
    try:
        assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["betas"] == (0.9, 0.99)
        assert opt.offloaded_bytes > 0
        own = _connect.process_stash()
        assert own.stats()["optimizer_state_bytes"] == opt.offloaded_bytes
        assert own.stats()["daemon_pid"] == fresh_daemon.proc.pid
        with OffloadAdamW(model.parameters()) as another:  # the same session again
            assert _connect.process_stash() is own and another.offloaded_bytes > 0
        for _ in range(3):
            for m, o in ((plain, reference), (model, opt)):
                o.zero_grad()
                loss_fn(m, idx).backward()
                o.step()
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a, b)
    finally:
        opt.close()
        _connect.process_stash().close()
    # Closed, the next optimizer without stash= gets a new session.
    second = OffloadAdamW(model.parameters(), 1e-3)
    try:
        assert _connect.process_stash() is not own and second.offloaded_bytes > 0
    finally:
        second.close()
        _connect.process_stash().close()


def test_the_old_positional_stash_is_refused_with_the_new_form(fresh_daemon):
    with actstash.connect(fresh_daemon.socket) as stash:
        for old in (stash, stash.client):
            with pytest.raises(TypeError, match=r"OffloadAdamW\(params, lr=\.\.\., stash=stash\)"):
                OffloadAdamW([torch.nn.Parameter(torch.zeros(8))], old, lr=1e-3)
        assert stash.stats()["optimizer_state_bytes"] == 0  # nothing was reserved


def test_plan_answers_before_the_first_step(fresh_daemon):
    """Right after wrap(policy="auto"), plan() says what the first step will do (the
    README prints it there), and after the profiling steps it is the plan itself."""
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, heads=2, layers=3, context=16, dropout=0.0)
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    with actstash.connect(fresh_daemon.socket) as stash:
        assert stash.plan() is None  # nothing wrapped: no plan at all
        actstash.wrap(model, stash, policy="auto", budget="1GiB", min_bytes=0)
        pending = stash.plan()
        assert pending.pending and pending.choices is None and not pending.settled
        assert "profiles the 3 blocks" in str(pending) and "1.0 GiB" in str(pending)
        actstash.unwrap(model)
        actstash.wrap(model, stash, policy="auto", budget=0.5, min_bytes=0)
        assert "a fraction 0.5 of the free memory" in str(stash.plan())
        for _ in range(2 if _selective.supported() else 1):  # the ops, then the blocks
            loss_fn(model, idx).backward()
        stash.synchronize()
        after = stash.plan()
        assert after.pending is None and len(after.costs) == 3
        assert "pending" not in str(after)
        actstash.unwrap(model)


def test_a_budget_follows_one_rule():
    """A number of 1 or more is bytes, one below 1 a fraction of the free memory; a
    string is a size or a percentage of the free memory; anything else is refused."""
    from actstash._plan._auto import _resolve_budget
    cpu = torch.device("cpu")
    gib = 1 << 30
    for budget, expected in ((6e9, 6_000_000_000), (6_000_000_000, 6_000_000_000), (1, 1),
                             (1.0, 1), (0.5, gib // 2), ("50%", gib // 2), ("6GiB", 6 * gib),
                             ("6GB", 6_000_000_000), ("100%", gib)):
        assert _resolve_budget(budget, "1GiB", cpu) == expected, budget
    for bad in (1.5, 0, 0.0, -1, True, None, "lots", float("nan")):
        with pytest.raises(ValueError, match="budget"):
            _resolve_budget(bad, "1GiB", cpu)
