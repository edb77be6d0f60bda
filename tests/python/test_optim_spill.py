"""OffloadAdamW's states parked between steps, so that the daemon's spill tier can take
them under pool pressure: two trainers whose states together are more than the
daemon's pool, each offloading its activations too, train side by side bitwise equal
to torch.optim.AdamW(foreach=False); their state blocks went to disk and came back
(the daemon's counters per session); without parking the second one is refused.
Parking itself (no spill tier) changes no number: the step in pieces, state_dict,
load_state_dict and close on parked states, the fast mode, master weights, and the
device path on the simulated device."""
import copy
import ctypes
import os
import subprocess
import sys

import pytest
import torch

import actstash
from actstash.optim import OffloadAdamW
from actstash_testing.sim_device import SimulatedCopies
from conftest import EXAMPLES, PACKAGE_ENV, spilling_daemon
from optim_spill_run import big_model, train_step
from test_optim import (STEPS, _MasterReference, _low_precision_model, _mapping_of, _model,
                        _state_bytes, _train)
from test_optim_device import _device_run

POOL = 48 << 20
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim_spill_run.py")


@pytest.fixture(scope="module")
def spill_daemon():
    yield from spilling_daemon("48MiB", "2MiB", "actstash-optim-spill-")


def test_two_trainers_over_the_pool_spill_their_states_and_train_bitwise(spill_daemon):
    torch.set_num_threads(1)
    steps = 3
    plains = [big_model(10), big_model(11)]
    ours = [copy.deepcopy(m) for m in plains]
    references = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
                  for m in plains]
    need = _state_bytes(ours[0])
    assert POOL / 2 < need < POOL
    stashes = [actstash.connect(spill_daemon.socket) for _ in ours]
    try:
        first = OffloadAdamW(ours[0].parameters(), stash=stashes[0], lr=1e-3, weight_decay=0.1)
        # Unparked states stay in memory: the second trainer's do not fit beside the
        # first one's, and nothing of them is kept.
        with pytest.raises(actstash.StashFull, match="nothing was kept"):
            OffloadAdamW(ours[1].parameters(), stash=stashes[1], lr=1e-3, weight_decay=0.1,
                         spill=False)
        assert stashes[1].stats()["optimizer_state_bytes"] == 0
        # Parked (the default with a spill tier), they spill for each other.
        second = OffloadAdamW(ours[1].parameters(), stash=stashes[1], lr=1e-3, weight_decay=0.1)
        s = stashes[1].stats()  # before any activation: what spilled was state
        assert s["spills"] > 0 and s["tensors_offloaded"] == 0, s
        assert s["optimizer_state_bytes"] == need, s
        opts = [first, second]
        for step in range(steps):
            for model, opt, stash in zip(ours, opts, stashes):
                train_step(model, opt, step, stash)
                assert opt.state[next(model.parameters())]["exp_avg"].is_meta  # parked
        for model, reference in zip(plains, references):
            for step in range(steps):
                train_step(model, reference, step)
        for plain, model in zip(plains, ours):
            for a, b in zip(plain.parameters(), model.parameters()):
                assert torch.equal(a, b)
        for opt, stash in zip(opts, stashes):
            s = stash.stats()
            # Counted as state, not as activations; and they did go to disk and back.
            assert s["optimizer_state_bytes"] == need, s
            assert s["bytes_spilled"] > 0 and s["bytes_restored"] > 0, s
            assert s["tensors_offloaded"] > 0, s
        # state_dict copies parked states into the process, equal to torch's, and a
        # copy: the next step changes none of it.
        saved = first.state_dict()
        kept = copy.deepcopy(saved)
        for i, p in enumerate(plains[0].parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                value = saved["state"][i][key]
                assert torch.equal(value, references[0].state[p][key])
                assert "actstash-segment" not in _mapping_of(value.data_ptr())
        # Loaded back into the parked (partly spilled) states, one more step, then
        # closed: the same numbers as torch's all along.
        first.load_state_dict(saved)
        train_step(ours[0], first, steps, stashes[0])
        train_step(plains[0], references[0], steps)
        for i in saved["state"]:
            for key, value in saved["state"][i].items():
                assert torch.equal(value, kept["state"][i][key]), (i, key)
        before = stashes[0].stats()
        first.close()
        # Close reads back what is on disk then. (Since idle sessions give memory back
        # when asked, which of the two holds spilled states at this point depends on
        # when each was asked.)
        if before["spilled_now_bytes"] > 0:
            assert stashes[0].stats()["bytes_restored"] > before["bytes_restored"]
        for a, b in zip(plains[0].parameters(), ours[0].parameters()):
            assert torch.equal(a, b)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(first.state[b][key], references[0].state[a][key])
        del first, second, opts, saved
    finally:
        for stash in stashes:
            stash.close()


def _parked(socket, model, steps, **options):
    stash = actstash.connect(socket)
    opt = OffloadAdamW(model.parameters(), stash=stash, lr=3e-3, weight_decay=0.1, spill=True,
                       spill_chunk_bytes=64 << 10, **options)
    _train(model, opt, steps)
    return stash, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parking_in_pieces_changes_no_number(fresh_daemon, dtype):
    """No spill tier, chunks of 64 KiB (several per step): bitwise the reference, and
    state_dict / load_state_dict / close work on parked states."""
    torch.set_num_threads(1)
    if dtype == torch.float32:
        plain = _model()
        reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1,
                                      foreach=False)
        torch_states = lambda p: reference.state[p]  # noqa: E731
    else:
        plain = _low_precision_model(dtype)
        reference = _MasterReference(plain, lr=3e-3, weight_decay=0.1)
        masters = {id(p): m for p, m in zip(reference.params, reference.masters)}
        torch_states = lambda p: reference.opt.state[masters[id(p)]]  # noqa: E731
    ours = copy.deepcopy(plain)
    _train(plain, reference, STEPS // 2)
    stash, opt = _parked(fresh_daemon.socket, ours, STEPS // 2)
    try:
        assert len(opt._chunks(list(ours.parameters()))) > 2
        for a, b in zip(plain.parameters(), ours.parameters()):
            assert torch.equal(a, b)
        saved = opt.state_dict()
        for i, (a, b) in enumerate(zip(plain.parameters(), ours.parameters())):
            assert opt.state[b]["exp_avg"].is_meta
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(saved["state"][i][key], torch_states(a)[key])
        # Resumed into a new parked optimizer, then closed half way: the same numbers.
        resumed = copy.deepcopy(ours)
        again = OffloadAdamW(resumed.parameters(), stash=stash, lr=3e-3, weight_decay=0.1,
                             spill=True, spill_chunk_bytes=64 << 10)
        again.load_state_dict(saved)
        assert next(iter(again.state.values()))["exp_avg"].is_meta
        _train(resumed, again, 2, start=STEPS // 2)
        again.close()
        assert not again.state[next(resumed.parameters())]["exp_avg"].is_meta
        _train(resumed, again, STEPS // 2 - 2, start=STEPS // 2 + 2)
        _train(plain, reference, STEPS // 2, start=STEPS // 2)
        _train(ours, opt, STEPS // 2, start=STEPS // 2)
        for a, b, c in zip(plain.parameters(), ours.parameters(), resumed.parameters()):
            assert torch.equal(a, b) and torch.equal(a, c)
        del opt, again
    finally:
        stash.close()


def test_parked_fast_mode_is_the_unparked_fast_mode(fresh_daemon):
    torch.set_num_threads(1)
    a, b = _model(4), _model(4)
    stash = actstash.connect(fresh_daemon.socket)
    try:
        unparked = OffloadAdamW(a.parameters(), stash=stash, lr=3e-3, weight_decay=0.1, mode="fast",
                                spill=False)
        _train(a, unparked, STEPS // 2)
        parked_stash, parked = _parked(fresh_daemon.socket, b, STEPS // 2, mode="fast")
        for x, y in zip(a.parameters(), b.parameters()):
            assert torch.equal(x, y)
        del parked
        parked_stash.close()
    finally:
        stash.close()


def test_parked_device_path_is_bitwise_with_the_same_copies(fresh_daemon):
    """The device path with parked states, stepped and copied back a piece at a time:
    the same parameters as unparked, the same bytes each way and the same waits."""
    torch.set_num_threads(1)
    plain = _model()
    parked = copy.deepcopy(plain)
    counts = []
    for model, options in ((plain, {}), (parked, {"spill": True,
                                                  "spill_chunk_bytes": 64 << 10})):
        copies = SimulatedCopies(delay_s=0.001)
        opt, _, _ = _device_run(fresh_daemon.socket, model, copies, steps=3, options=options)
        counts.append((copies.bytes_to_host, copies.bytes_to_device, copies.waits))
        assert opt._parking == bool(options)
    for a, b in zip(plain.parameters(), parked.parameters()):
        assert torch.equal(a, b)
    assert counts[0] == counts[1]


def test_park_and_locate_of_the_client(spill_daemon):
    """The client calls under parking: a parked buffer keeps its bytes when located
    again (not counted as a fetch); an unknown or released ticket is StashNotFound.
    (Spilled and read back in between: test_two_trainers_...)"""
    stash = actstash.connect(spill_daemon.socket)
    try:
        client = stash.client
        ticket, address = client.reserve(4096)
        torch.frombuffer((ctypes.c_byte * 4096).from_address(address), dtype=torch.uint8)[:] = 7
        client.park(ticket)
        fetches = client.zero_copy_usage()["fetches"]
        located = client.locate(ticket)
        data = torch.frombuffer((ctypes.c_byte * 4096).from_address(located), dtype=torch.uint8)
        assert bool((data == 7).all())
        assert client.zero_copy_usage()["fetches"] == fetches
        with pytest.raises(actstash.StashNotFound):
            client.park(ticket + 1000)
        with pytest.raises(actstash.StashNotFound):
            client.locate(ticket + 1000)
        client.release(ticket, 4096)
        with pytest.raises(actstash.StashNotFound):
            client.locate(ticket)
    finally:
        stash.close()


def test_two_trainer_processes_at_once_spill_and_train_bitwise(spill_daemon, tmp_path):
    """The same two trainers as processes stepping at the same time (DDP's ranks do):
    each spills and reads back its own states while the other holds the rest of the
    pool, and neither waits for the other to finish."""
    steps = 3
    ready = tmp_path / "ready"
    ready.mkdir()
    env = dict(os.environ, **PACKAGE_ENV, ACTSTASH_ADDRESS=spill_daemon.socket)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), EXAMPLES]))
    runs = [subprocess.Popen([sys.executable, WORKER, str(seed), str(steps), str(ready),
                              str(tmp_path / f"{seed}.pt")], env=env, stderr=subprocess.PIPE,
                             text=True) for seed in (20, 21)]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
    torch.set_num_threads(1)
    for seed in (20, 21):
        result = torch.load(tmp_path / f"{seed}.pt")
        plain = big_model(seed)
        reference = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1,
                                      foreach=False)
        for step in range(steps):
            train_step(plain, reference, step)
        for a, b in zip(plain.parameters(), result["params"]):
            assert torch.equal(a, b)
        s = result["stats"]
        assert result["parked"]
        assert s["optimizer_state_bytes"] == _state_bytes(plain), s
        assert s["bytes_spilled"] > 0 and s["bytes_restored"] > 0, s


def test_device_path_states_spill_beside_the_host_copies(spill_daemon):
    """The device path's host copies of parameters and gradients never spill (hooks
    write them during backward); reserved before every state, they leave the states'
    leases spillable: 25.6 MiB of copies and 25.6 MiB of moments in a 48 MiB pool."""
    torch.set_num_threads(1)
    plain = big_model(12)
    ours = copy.deepcopy(plain)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    copies = SimulatedCopies(delay_s=0.0)
    copies.device_addresses = {p.data_ptr() for p in ours.parameters()}
    stash = actstash.connect(spill_daemon.socket)
    try:
        opt = OffloadAdamW(ours.parameters(), stash=stash, lr=1e-3, weight_decay=0.1,
                           _copies=copies)
        assert stash.stats()["spills"] > 0
        for step in range(2):
            train_step(ours, opt, step)
            train_step(plain, reference, step)
        for a, b in zip(plain.parameters(), ours.parameters()):
            assert torch.equal(a, b)
        s = stash.stats()
        assert s["bytes_restored"] > 0, s
        assert copies.bytes_to_device == 2 * sum(4 * p.numel() for p in ours.parameters())
        del opt
    finally:
        copies.close()
        stash.close()
