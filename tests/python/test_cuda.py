"""CUDA tensors through actstash: D2H straight into leased (pinned) memory on the
copy engine's stream, H2D back with the compute stream waiting on an event.
Gradients must be bitwise equal to plain autograd, also when the compute
stream is deliberately slow. Skipped without a GPU (torch and actstash both
need one); the pinning-policy tests run everywhere."""
import json
import os

import pytest
import torch
from torch import nn

import actstash
from actstash._native import lib as _lib

CUDA = torch.cuda.is_available() and _lib.cuda_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch and actstash)")


class Views(nn.Module):
    """Saved tensors that are transposes, slices with gaps and broadcasts."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 384)

    def forward(self, x, slow_cycles=0):
        h = self.lin(x)
        if slow_cycles:
            torch.cuda._sleep(slow_cycles)  # the producer kernel finishes late
        t = h.t()
        gaps = torch.sigmoid(h)[:, ::3]
        wide = h.unsqueeze(0).expand(4, -1, -1)
        return (gaps * gaps.exp()).sum() + (wide * 1.5).sum() + (t @ torch.tanh(h)).sum()


def run(stash, slow_cycles=0, steps=2, stream=None):
    torch.manual_seed(0)
    model = Views().cuda()
    x = torch.randn(512, 256, device="cuda")
    for _ in range(steps):
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            if stash is None:
                loss = model(x, slow_cycles)
            else:
                with stash.offload(min_bytes=0):
                    loss = model(x, slow_cycles)
            loss.backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters()]


def assert_bitwise(expected, actual):
    for i, (a, b) in enumerate(zip(expected, actual)):
        assert torch.equal(a, b), f"gradient {i} differs"


@needs_gpu
def test_cuda_offload_is_bitwise_equal_and_pinned(daemon):
    stash = actstash.connect(daemon.socket)
    try:
        assert stash.client.attached
        expected = run(None)
        actual = run(stash)
        assert_bitwise(expected, actual)
        stats = stash.stats()
        assert stats["tensors_offloaded"] > 0 and stats["cuda_kept"] == 0
        assert stats["pinned_bytes"] > 0 and stats["pin_error"] is None
    finally:
        stash.close()


@needs_gpu
@pytest.mark.parametrize("side_stream", [False, True])
def test_slow_compute_stream_never_races_the_copies(daemon, side_stream):
    stash = actstash.connect(daemon.socket)
    try:
        stream = torch.cuda.Stream() if side_stream else None
        expected = run(None, slow_cycles=50_000_000, stream=stream)
        actual = run(stash, slow_cycles=50_000_000, stream=stream)
        assert_bitwise(expected, actual)
    finally:
        stash.close()


@needs_gpu
def test_cuda_false_keeps_cuda_tensors_on_the_gpu(daemon):
    stash = actstash.connect(daemon.socket, cuda=False)
    try:
        assert_bitwise(run(None), run(stash))
        assert stash.stats()["tensors_offloaded"] == 0
        assert stash.stats()["cuda_kept"] > 0
    finally:
        stash.close()


@pytest.mark.skipif(CUDA, reason="checks the behaviour without a usable CUDA device")
def test_required_pinning_without_a_device_says_why(daemon):
    stash = actstash.connect(daemon.socket, pin="on")
    try:
        # Attaching needs a registrar; without one the client stays on the inline path
        # (attach="auto") and says why.
        assert not stash.client.attached
        assert "cannot pin memory for CUDA" in stash.client.attach_error
    finally:
        stash.close()
    with pytest.raises(actstash.StashError, match="cannot pin memory for CUDA"):
        actstash.connect(daemon.socket, pin="on", attach="required")


def test_auto_pinning_without_a_device_is_silent_and_unpinned(daemon):
    stash = actstash.connect(daemon.socket)
    try:
        with stash.offload(min_bytes=0):
            y = (torch.randn(64, 64, requires_grad=True) * 2).sum()
        y.backward()
        stats = stash.stats()
        if not CUDA:
            assert stats["pinned_bytes"] == 0 and stats["pin_error"] is None
        assert stats["unpinned_leases"] == 0
    finally:
        stash.close()


def test_bad_pin_value_is_a_value_error(daemon):
    with pytest.raises(ValueError, match="pin_leases: 'sometimes' is not one of auto, on, off"):
        actstash.connect(daemon.socket, pin="sometimes")
    # The C ABI checks (for callers other than this package too), with the daemon's
    # wording for its own settings, and hands back no handle.
    import ctypes
    cases = (({"pin_leases": "sometimes"}, "pin_leases: 'sometimes' is not one of auto, on, off"),
             ({"attach": "always"}, "attach: 'always' is not one of auto, required, off"))
    for settings, message in cases:
        handle = ctypes.c_void_p()
        code = _lib.client_connect(json.dumps(dict(settings, address=daemon.socket)).encode(),
                                   ctypes.byref(handle))
        with pytest.raises(ValueError) as error:
            _lib.raise_for(code)
        assert str(error.value) == message
        assert not handle.value


def test_device_pool_that_the_daemon_lacks_is_a_clear_error(daemon):
    with pytest.raises(ValueError, match="--device-pool"):
        actstash.connect(daemon.socket, device_pool=0)


@needs_gpu
def test_device_pool_offload_is_bitwise_equal():
    from conftest import Daemon
    d = Daemon(extra=("--device-pool", "0:1GiB", "--allow-uid", str(os.getuid())))
    try:
        stash = actstash.connect(d.socket, device_pool=0)
        try:
            assert_bitwise(run(None), run(stash))
            assert stash.stats()["tensors_offloaded"] > 0
            pools = stash.client.stats()
            assert pools["self"]["leases"] > 0
        finally:
            stash.close()
    finally:
        d.stop()


@needs_gpu
def test_auto_plan_on_cuda_is_bitwise_and_within_budget(daemon):
    """wrap(policy="auto") on a CUDA GPT: every step bitwise equal to plain
    autograd; after the plan is checked, the step's peak of allocated memory from
    the first block on (torch.cuda.max_memory_allocated) stays within a budget
    halfway between the smallest reachable peak and keeping everything."""
    import copy
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "examples"))
    from gpt import GPT, loss_fn
    torch.manual_seed(0)
    model = GPT(vocab=512, dim=256, heads=4, layers=6, context=256).cuda()
    plain = copy.deepcopy(model)
    idx = torch.randint(0, 512, (16, 257), device="cuda")
    stash = actstash.connect(daemon.socket)

    def step(m, k):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(100 + k)
        loss_fn(m, idx).backward()
        torch.cuda.synchronize()
        return [p.grad.clone() for p in m.parameters()]

    try:
        actstash.wrap(model, stash, policy="auto", budget=1 << 40)
        for k in range(2):
            assert_bitwise(step(plain, k), step(model, k))
        report = stash.plan()
        budget = (report.smallest_peak + report.kept_peak) // 2
        actstash.unwrap(model)
        actstash.wrap(model, stash, policy="auto", budget=budget)
        start = {}
        model.blocks[0].register_forward_pre_hook(
            lambda m, a: start.update(at=torch.cuda.memory_allocated()) or
            torch.cuda.reset_peak_memory_stats())
        for k in range(6):
            assert_bitwise(step(plain, k), step(model, k))
            if k >= 4:
                assert torch.cuda.max_memory_allocated() - start["at"] <= budget, str(stash.plan())
        assert stash.plan().choices != ["keep"] * 6, str(stash.plan())
    finally:
        actstash.unwrap(model)
        stash.close()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_adamw_on_cuda_parameters_is_bitwise_the_host_step(daemon, dtype):
    """OffloadAdamW on CUDA parameters (the device path): gradients to the pool as
    each becomes final, the step on the host, parameters back before the next
    forward, with a compute stream slowed before every forward. Each step's
    parameters are bitwise torch.optim.AdamW(foreach=False) on host copies stepped
    with the same (clipped, accumulated) gradients, on fp32 masters for bf16."""
    from actstash.optim import OffloadAdamW
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda().to(dtype)
    masters = [p.detach().float().cpu() for p in model.parameters()]
    reference = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1, foreach=False)
    stash = actstash.connect(daemon.socket)
    try:
        opt = OffloadAdamW(model.parameters(), stash=stash, lr=1e-3, weight_decay=0.1)
        assert stash.stats()["optimizer_state_bytes"] >= opt.offloaded_bytes > 0
        before = [p.detach().cpu() for p in model.parameters()]
        g = torch.Generator(device="cuda").manual_seed(1)
        for step in range(5):
            for micro in range(2):
                torch.cuda._sleep(2_000_000)  # the forward's kernels start late
                x = torch.randn(64, 256, device="cuda", generator=g).to(dtype)
                (model(x).float().square().mean() / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.detach().float().cpu()
            reference.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for m, p in zip(masters, model.parameters()):
                assert torch.equal(m.to(dtype), p.detach().cpu()), step
        assert any(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, model.parameters()))
    finally:
        stash.close()
