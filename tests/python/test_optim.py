"""actstash.optim.OffloadAdamW against torch.optim.AdamW(foreach=False) on the
same seed: Adam's states live in the daemon's pool (the session's leased
memory: the daemon's pool usage and stats() say so), and the parameters after
20 steps with gradient accumulation, clip_grad_norm_ and bf16 autocast are
bitwise equal in the default mode; bf16 and fp16 models get fp32 master
weights in the pool, bitwise equal to torch's AdamW on fp32 copies stepped
with the cast gradients; state_dict() resumes bitwise with or without
actstash; bad parameters and a quota too small are refused at construction
with nothing kept; mode="fast" (the C++ step) stays within its
stated tolerance."""
import copy
import gc

import pytest
import torch

import actstash
from actstash.optim import OffloadAdamW
from gpt import GPT, loss_fn

STEPS = 20
MICRO = 4


def _model(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return GPT(vocab=128, dim=64, heads=4, layers=2, context=32, dropout=dropout)


def _train(model, opt, steps, start=0, autocast=False):
    """`steps` optimizer steps of MICRO accumulated micro-batches each, the
    gradient clipped before the step, the data a function of the step."""
    for step in range(start, start + steps):
        for micro in range(MICRO):
            g = torch.Generator().manual_seed(1000 * step + micro)
            idx = torch.randint(0, 128, (4, 33), generator=g)
            if autocast:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(model, idx) / MICRO
            else:
                loss = loss_fn(model, idx) / MICRO
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _mapping_of(address):
    """The file behind the mapping of `address` in this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else ""
    return ""


def _state_bytes(model, moments=2):
    return moments * sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_bitwise_equal_to_torch_adamw_with_states_in_the_pool(fresh_daemon, autocast):
    torch.set_num_threads(1)
    plain = _model()
    ours = copy.deepcopy(plain)
    reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    stash = actstash.connect(fresh_daemon.socket)
    try:
        before = stash.client.stats()["pool"]["used_bytes"]
        opt = OffloadAdamW(ours.parameters(), stash=stash, lr=3e-3, weight_decay=0.1)
        expected = _state_bytes(ours)
        # The states went to the daemon: its pool holds them, the stats count them.
        assert opt.offloaded_bytes == expected
        assert stash.stats()["optimizer_state_bytes"] >= expected
        assert stash.client.stats()["pool"]["used_bytes"] - before >= expected
        _train(plain, reference, STEPS, autocast=autocast)
        _train(ours, opt, STEPS, autocast=autocast)
        for a, b in zip(plain.parameters(), ours.parameters()):
            assert torch.equal(a, b)
        for a, b in zip(plain.parameters(), ours.parameters()):
            ra, rb = reference.state[a], opt.state[b]
            assert torch.equal(ra["exp_avg"], rb["exp_avg"])
            assert torch.equal(ra["exp_avg_sq"], rb["exp_avg_sq"])
            assert float(ra["step"]) == float(rb["step"]) == STEPS
        # Every state tensor is a view of the pool's memory (a mapped segment memfd),
        # not of the process heap.
        for p in ours.parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                assert "actstash-segment" in _mapping_of(opt.state[p][key].data_ptr())
        del opt, ra, rb
        gc.collect()
        assert stash.stats()["optimizer_state_bytes"] == 0
    finally:
        stash.close()


def test_state_dict_resumes_bitwise_with_or_without_actstash(fresh_daemon):
    torch.set_num_threads(1)
    stash = actstash.connect(fresh_daemon.socket)
    try:
        straight = _model(1)
        first = copy.deepcopy(straight)
        reference = torch.optim.AdamW(straight.parameters(), lr=1e-3, foreach=False)
        _train(straight, reference, STEPS)

        opt = OffloadAdamW(first.parameters(), stash=stash, lr=1e-3)
        _train(first, opt, STEPS // 2)
        saved = copy.deepcopy(opt.state_dict())
        weights = copy.deepcopy(first.state_dict())

        # Resumed into a new OffloadAdamW: the loaded moments go into its pool buffers.
        resumed = _model(1)
        resumed.load_state_dict(weights)
        opt2 = OffloadAdamW(resumed.parameters(), stash=stash, lr=1e-3)
        opt2.load_state_dict(copy.deepcopy(saved))
        assert opt2.offloaded_bytes == _state_bytes(resumed)
        _train(resumed, opt2, STEPS // 2, start=STEPS // 2)
        # And into torch's own AdamW.
        plain = _model(1)
        plain.load_state_dict(weights)
        opt3 = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=False)
        opt3.load_state_dict(copy.deepcopy(saved))
        _train(plain, opt3, STEPS // 2, start=STEPS // 2)
        for a, b, c in zip(straight.parameters(), resumed.parameters(), plain.parameters()):
            assert torch.equal(a, b) and torch.equal(a, c)
    finally:
        stash.close()


def test_bad_parameters_and_a_small_quota_are_refused_with_nothing_kept(fresh_daemon):
    stash = actstash.connect(fresh_daemon.socket)
    try:
        with pytest.raises(ValueError, match="not contiguous"):
            OffloadAdamW([torch.nn.Parameter(torch.zeros(8, 8).t())], stash=stash)
        with pytest.raises(ValueError, match="not fp32, bf16 or fp16"):
            OffloadAdamW([torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))], stash=stash)
        with pytest.raises(ValueError, match="several devices"):
            OffloadAdamW([torch.nn.Parameter(torch.zeros(8)),
                          torch.nn.Parameter(torch.zeros(8, device="meta"))], stash=stash)
        with pytest.raises(ValueError, match="sparse"):
            OffloadAdamW([torch.nn.Parameter(torch.zeros(4, 4).to_sparse())], stash=stash)
        assert stash.stats()["optimizer_state_bytes"] == 0
    finally:
        stash.close()
    # A session whose quota cannot hold the states: StashFull, and nothing kept.
    small = actstash.connect(fresh_daemon.socket, quota="16MiB")
    try:
        big = [torch.nn.Parameter(torch.zeros(1 << 20)) for _ in range(4)]  # 4 MiB each
        with pytest.raises(actstash.StashFull, match="nothing was kept"):
            OffloadAdamW(big, stash=small)
        gc.collect()
        assert small.stats()["optimizer_state_bytes"] == 0
        assert small.client.stats()["self"]["leased_bytes"] <= 16 << 20
    finally:
        small.close()


def test_fraction_keeps_the_last_parameters_states_in_the_process(fresh_daemon):
    stash = actstash.connect(fresh_daemon.socket)
    try:
        model = _model(2)
        opt = OffloadAdamW(model.parameters(), stash=stash, fraction=0.5)
        total = _state_bytes(model)
        assert 0 < opt.offloaded_bytes <= total / 2
        plain = copy.deepcopy(model)
        reference = torch.optim.AdamW(plain.parameters(), foreach=False)
        _train(model, opt, 3)
        _train(plain, reference, 3)
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a, b)
    finally:
        stash.close()


def test_fast_mode_stays_within_its_tolerance(fresh_daemon):
    """The C++ step rounds each operation on its own (kernels/adamw.h): with the same
    gradients, parameters stay within 2e-5 * lr per step of torch's; trained, the
    loss stays within 1e-3 of torch's."""
    torch.set_num_threads(2)
    stash = actstash.connect(fresh_daemon.socket)
    try:
        torch.manual_seed(0)
        start = torch.randn(100_000)
        grads = [torch.randn(100_000) * 0.1 for _ in range(STEPS)]
        a = torch.nn.Parameter(start.clone())
        b = torch.nn.Parameter(start.clone())
        reference = torch.optim.AdamW([a], lr=3e-3, weight_decay=0.1, foreach=False)
        opt = OffloadAdamW([b], stash=stash, lr=3e-3, weight_decay=0.1, mode="fast")
        assert "actstash-segment" in _mapping_of(opt.state[b]["exp_avg"].data_ptr())
        for g in grads:
            a.grad, b.grad = g.clone(), g.clone()
            reference.step()
            opt.step()
        gap = (a - b).abs().max().item()
        assert gap <= 2e-5 * 3e-3 * STEPS, gap
        # The step wrote the pool's moments (the C++ kernel updates them in place).
        assert opt.state[b]["exp_avg"].abs().max().item() > 0

        plain = _model(3)
        ours = copy.deepcopy(plain)
        reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1,
                                      foreach=False)
        opt = OffloadAdamW(ours.parameters(), stash=stash, lr=3e-3, weight_decay=0.1, mode="fast")
        assert opt.offloaded_bytes == _state_bytes(ours)
        _train(plain, reference, STEPS)
        _train(ours, opt, STEPS)
        idx = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            expected, actual = loss_fn(plain, idx).item(), loss_fn(ours, idx).item()
        assert abs(expected - actual) <= 1e-3 * abs(expected), (expected, actual)
        with pytest.raises(ValueError, match="amsgrad"):
            OffloadAdamW(ours.parameters(), stash=stash, amsgrad=True, mode="fast")
    finally:
        stash.close()


class _MasterReference:
    """What mixed-precision training with fp32 master weights does, with torch's own
    optimizer: torch.optim.AdamW(foreach=False) on fp32 copies of the parameters,
    stepped with the gradients cast to fp32, the result rounded into the parameters."""

    def __init__(self, model, **kwargs):
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, foreach=False, **kwargs)

    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _low_precision_model(dtype, seed=0):
    model = _model(seed).to(dtype)
    try:
        loss_fn(model, torch.zeros(1, 33, dtype=torch.long)).backward()
    except RuntimeError as error:  # torch 1.13 has few fp16 CPU kernels
        pytest.skip(f"this torch cannot train a {dtype} model on the CPU: {error}")
    model.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_parameters_get_fp32_master_weights_in_the_pool(fresh_daemon, dtype):
    torch.set_num_threads(1)
    plain = _low_precision_model(dtype)
    ours = copy.deepcopy(plain)
    reference = _MasterReference(plain, lr=3e-3, weight_decay=0.1)
    stash = actstash.connect(fresh_daemon.socket)
    try:
        before = stash.client.stats()["pool"]["used_bytes"]
        opt = OffloadAdamW(ours.parameters(), stash=stash, lr=3e-3, weight_decay=0.1)
        expected = _state_bytes(ours, moments=3)  # the master and two moments, fp32
        assert opt.offloaded_bytes == expected
        assert stash.stats()["optimizer_state_bytes"] >= expected
        assert stash.client.stats()["pool"]["used_bytes"] - before >= expected
        _train(plain, reference, STEPS)
        _train(ours, opt, STEPS)
        for a, b, master in zip(plain.parameters(), ours.parameters(), reference.masters):
            assert b.dtype == dtype
            assert torch.equal(a, b)
            state = opt.state[b]
            assert torch.equal(state["master_weight"], master)
            ra = reference.opt.state[master]
            for key in ("exp_avg", "exp_avg_sq"):
                assert state[key].dtype == torch.float32
                assert torch.equal(state[key], ra[key])
            assert float(state["step"]) == STEPS
            for key in ("master_weight", "exp_avg", "exp_avg_sq"):
                assert "actstash-segment" in _mapping_of(state[key].data_ptr())
        # The masters moved: 20 steps changed what rounding alone would keep.
        assert any(not torch.equal(m, m.to(dtype).float()) for m in reference.masters)
        # torch's AdamW on the bf16 parameters themselves is another computation.
        lone = _low_precision_model(dtype)
        lone_opt = torch.optim.AdamW(lone.parameters(), lr=3e-3, weight_decay=0.1,
                                     foreach=False)
        _train(lone, lone_opt, STEPS)
        assert any(not torch.equal(a, b) for a, b in zip(lone.parameters(), ours.parameters()))
    finally:
        stash.close()


def test_master_weights_resume_bitwise_and_fraction_keeps_some_in_the_process(fresh_daemon):
    torch.set_num_threads(1)
    stash = actstash.connect(fresh_daemon.socket)
    try:
        straight = _low_precision_model(torch.bfloat16, seed=4)
        first = copy.deepcopy(straight)
        reference = _MasterReference(straight, lr=1e-3)
        _train(straight, reference, STEPS)

        opt = OffloadAdamW(first.parameters(), stash=stash, lr=1e-3)
        _train(first, opt, STEPS // 2)
        saved = copy.deepcopy(opt.state_dict())
        for state in saved["state"].values():  # saved as they are: fp32, not the params' dtype
            assert state["master_weight"].dtype == state["exp_avg"].dtype == torch.float32
        weights = copy.deepcopy(first.state_dict())
        resumed = _low_precision_model(torch.bfloat16, seed=4)
        resumed.load_state_dict(weights)
        opt2 = OffloadAdamW(resumed.parameters(), stash=stash, lr=1e-3, fraction=0.5)
        total = _state_bytes(resumed, moments=3)
        assert 0 < opt2.offloaded_bytes <= total / 2
        pooled = {id(p) for p in opt2._pooled}
        in_process = [p for p in resumed.parameters() if id(p) not in pooled]
        assert in_process
        for p in in_process:
            assert "actstash-segment" not in _mapping_of(opt2.state[p]["master_weight"].data_ptr())
        opt2.load_state_dict(copy.deepcopy(saved))
        _train(resumed, opt2, STEPS // 2, start=STEPS // 2)
        for a, b in zip(straight.parameters(), resumed.parameters()):
            assert torch.equal(a, b)
        for p, master in zip(resumed.parameters(), reference.masters):
            assert torch.equal(opt2.state[p]["master_weight"], master)
    finally:
        stash.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fast_mode_steps_the_master_weights(fresh_daemon, dtype):
    """With the same bf16 (fp16) gradients, the C++ step keeps the fp32 master within
    the fp32 tolerance of torch's step on an fp32 copy, and the parameter is the master
    rounded (bf16: in the kernel; fp16: through the scratch gradient and a copy)."""
    torch.set_num_threads(2)
    stash = actstash.connect(fresh_daemon.socket)
    try:
        torch.manual_seed(0)
        start = torch.randn(100_000).to(dtype)
        grads = [(torch.randn(100_000) * 0.1).to(dtype) for _ in range(STEPS)]
        a = torch.nn.Parameter(start.clone())
        b = torch.nn.Parameter(start.clone())
        reference = _MasterReference(torch.nn.ParameterList([a]), lr=3e-3, weight_decay=0.1)
        opt = OffloadAdamW([b], stash=stash, lr=3e-3, weight_decay=0.1, mode="fast")
        master = opt.state[b]["master_weight"]
        assert "actstash-segment" in _mapping_of(master.data_ptr())
        for g in grads:
            a.grad, b.grad = g.clone(), g.clone()
            reference.step()
            opt.step()
        gap = (reference.masters[0] - master).abs().max().item()
        assert gap <= 2e-5 * 3e-3 * STEPS, gap
        assert not torch.equal(master, start.float())  # it moved
        assert torch.equal(b, master.to(dtype))
    finally:
        stash.close()


def test_master_weights_survive_close_errors_hooks_and_new_weights(fresh_daemon):
    """close() moves the masters into the process and the step goes on updating the
    ones state_dict() saves; a sparse gradient is refused before anything is stepped;
    torch 2.x step hooks run once per step; weights loaded into the model after the
    optimizer was made seed the masters; add_param_group is refused."""
    torch.set_num_threads(1)
    stash = actstash.connect(fresh_daemon.socket)
    try:
        plain = _low_precision_model(torch.bfloat16, seed=6)
        ours = copy.deepcopy(plain)
        opt = OffloadAdamW(ours.parameters(), stash=stash, lr=1e-3)
        # New weights after the optimizer exists (as model.load_state_dict does).
        other = _low_precision_model(torch.bfloat16, seed=7)
        plain.load_state_dict(other.state_dict())
        ours.load_state_dict(other.state_dict())
        reference = _MasterReference(plain, lr=1e-3)
        calls = []
        if hasattr(opt, "register_step_pre_hook"):  # torch 2.x
            opt.register_step_pre_hook(lambda *args: calls.append("pre"))
            opt.register_step_post_hook(lambda *args: calls.append("post"))
        _train(plain, reference, 3)
        _train(ours, opt, 3)
        if hasattr(opt, "register_step_pre_hook"):
            assert calls == ["pre", "post"] * 3
        for a, b in zip(plain.parameters(), ours.parameters()):
            assert torch.equal(a, b)

        opt.close()
        gc.collect()
        assert stash.stats()["optimizer_state_bytes"] == 0
        _train(plain, reference, 3, start=3)
        _train(ours, opt, 3, start=3)
        saved = opt.state_dict()["state"]
        pairs = zip(plain.parameters(), ours.parameters(), reference.masters)
        for i, (a, b, master) in enumerate(pairs):
            assert torch.equal(a, b)
            assert torch.equal(saved[i]["master_weight"], master)

        before = [p.detach().clone() for p in ours.parameters()]
        first = next(ours.parameters())
        for p in ours.parameters():
            p.grad = torch.zeros_like(p)
        first.grad = first.grad.to_sparse()
        with pytest.raises(RuntimeError, match="sparse"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))
        opt.state_dict()  # no alias left behind
        with pytest.raises(ValueError, match="add_param_group"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))]})
    finally:
        stash.close()
