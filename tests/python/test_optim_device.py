"""OffloadAdamW's device path on a simulated device (actstash_testing.sim_device):
CPU parameters stand for a GPU's, the copies between them and the pool run on a
side-stream thread that sleeps before each one. Every gradient goes to the pool
while backward runs (register_post_accumulate_grad_hook, torch >= 2.1; at the
step on torch 1.13), the step runs on the host copies, the new parameters go
back before the next forward: bitwise equal to torch.optim.AdamW(foreach=False)
with 4 accumulated micro-batches and clip_grad_norm_, in fp32 and with bf16
master weights; the copies ran (counted by the simulated device) and the states
and host copies are in the pool. Without the waits the same run differs, so the
delays do expose a missing one."""
import copy

import pytest
import torch

import actstash
from actstash.optim import OffloadAdamW
from actstash_testing.sim_device import SimulatedCopies
from gpt import loss_fn
from test_optim import _MasterReference, _low_precision_model, _model, _train

STEPS = 6
MICRO = 4  # test_optim._train's micro-batches per step


def _train_steps(model, opt, steps, clip=True, scaler=None, inf_at=None):
    """test_optim._train's steps, optionally without clip_grad_norm_, or through a
    GradScaler (an inf put into one gradient at step `inf_at`: the step is skipped)."""
    if clip and scaler is None:
        return _train(model, opt, steps)
    for step in range(steps):
        for micro in range(MICRO):
            g = torch.Generator().manual_seed(1000 * step + micro)
            idx = torch.randint(0, 128, (4, 33), generator=g)
            loss = loss_fn(model, idx) / MICRO
            (loss if scaler is None else scaler.scale(loss)).backward()
        if step == inf_at:
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = float("inf")
        if scaler is None:
            opt.step()
        else:
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)


def _device_run(socket, model, copies, mode="exact", steps=STEPS, options=None, **train):
    copies.device_addresses = {p.data_ptr() for p in model.parameters()}
    stash = actstash.connect(socket)
    try:
        opt = OffloadAdamW(model.parameters(), stash=stash, lr=3e-3, weight_decay=0.1, mode=mode,
                           _copies=copies, **(options or {}))
        in_pool = stash.stats()["optimizer_state_bytes"]
        offloaded = opt.offloaded_bytes
        _train_steps(model, opt, steps, **train)
        return opt, in_pool, offloaded
    finally:
        copies.close()
        stash.close()


HOOKS = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def _bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_path_is_bitwise_torch_adamw_with_delayed_copies(fresh_daemon, dtype, clip):
    torch.set_num_threads(1)
    if dtype == torch.float32:
        plain = _model()
        reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1,
                                      foreach=False)
    else:
        plain = _low_precision_model(dtype)
        reference = _MasterReference(plain, lr=3e-3, weight_decay=0.1)
    ours = copy.deepcopy(plain)
    copies = SimulatedCopies(delay_s=0.002)
    opt, in_pool, offloaded = _device_run(fresh_daemon.socket, ours, copies, clip=clip)
    _train_steps(plain, reference, STEPS, clip=clip)
    for a, b in zip(plain.parameters(), ours.parameters()):
        assert b.dtype == dtype
        assert torch.equal(a, b)
    # The states and the host copies of parameters and gradients were in the pool:
    # fp32 moments (and bf16's fp32 masters), plus two copies in the parameters' dtype.
    moments = 2 if dtype == torch.float32 else 3
    expected = sum(p.numel() * 4 * moments for p in ours.parameters()) + 2 * _bytes(ours)
    assert offloaded == expected
    assert in_pool >= expected
    # Every step's gradients went to the host and its parameters came back. The hooks
    # copy each micro-batch's accumulated gradient during backward, and the step uses
    # the last ones; clip_grad_norm_ changes them after, so the step copies them again.
    # Without the hooks (torch 1.13) the step copies them.
    per_step = (MICRO + (1 if clip else 0)) if HOOKS else 1
    assert copies.bytes_to_host == STEPS * per_step * _bytes(ours)
    assert copies.bytes_to_device == STEPS * _bytes(ours)
    # The trainer's stream waited for the parameters each step (and, with the hooks,
    # for each micro-batch's copy before the next accumulated into the gradient).
    assert copies.waits == STEPS * (1 + (MICRO - 1) * len(list(ours.parameters())) * HOOKS)


def test_without_the_waits_the_delayed_copies_give_other_numbers(fresh_daemon):
    """The check above can fail: the same run with a device that ignores the trainer's
    waits reads parameters still being copied (autograd sees them change under a saved
    tensor, or the numbers differ)."""
    torch.set_num_threads(1)
    plain = _model()
    reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    ours = copy.deepcopy(plain)

    class NoWaits(SimulatedCopies):
        def wait(self, stream, event):
            if stream is not self.current():
                super().wait(stream, event)

    try:
        _device_run(fresh_daemon.socket, ours, NoWaits(delay_s=0.02), steps=3)
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
        return
    _train(plain, reference, 3)
    assert any(not torch.equal(a, b) for a, b in zip(plain.parameters(), ours.parameters()))


def test_device_path_fast_mode_and_state_dict(fresh_daemon):
    """mode="fast" on the device path is bitwise the CPU trainer's fast step (the same
    C++ step on the same gradients); its state_dict loads into torch's AdamW."""
    torch.set_num_threads(1)
    on_cpu, fast = _model(), _model()
    stash = actstash.connect(fresh_daemon.socket)
    try:
        cpu_opt = OffloadAdamW(on_cpu.parameters(), stash=stash, lr=3e-3, weight_decay=0.1,
                               mode="fast")
        _train(on_cpu, cpu_opt, STEPS)
    finally:
        stash.close()
    opt, _, _ = _device_run(fresh_daemon.socket, fast, SimulatedCopies(delay_s=0.001),
                            mode="fast")
    for a, b in zip(on_cpu.parameters(), fast.parameters()):
        assert torch.equal(a, b)
    # Saved on the device path, loaded by torch's own AdamW: the same states.
    saved = opt.state_dict()
    torch_opt = torch.optim.AdamW(fast.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    torch_opt.load_state_dict(saved)
    for p in fast.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(torch_opt.state[p][key], opt.state[p][key])


def test_device_path_fraction_steps_the_rest_on_the_device(fresh_daemon):
    """fraction=0.5: the first parameters' states and copies in the pool, the others'
    states where the parameters are, stepped there by torch: bitwise all the same."""
    torch.set_num_threads(1)
    plain = _model()
    reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    ours = copy.deepcopy(plain)
    copies = SimulatedCopies(delay_s=0.001)
    copies.device_addresses = {p.data_ptr() for p in ours.parameters()}
    stash = actstash.connect(fresh_daemon.socket)
    try:
        opt = OffloadAdamW(ours.parameters(), stash=stash, lr=3e-3, weight_decay=0.1, fraction=0.5,
                           _copies=copies)
        hosted = [p for p in ours.parameters() if p in opt._host]
        assert 0 < len(hosted) < len(list(ours.parameters()))
        _train(plain, reference, STEPS)
        _train(ours, opt, STEPS)
        for a, b in zip(plain.parameters(), ours.parameters()):
            assert torch.equal(a, b)
        assert copies.bytes_to_device == STEPS * sum(p.numel() * 4 for p in hosted)
    finally:
        copies.close()
        stash.close()


@pytest.mark.skipif(not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"),
                    reason="torch.amp.GradScaler('cpu') needs torch >= 2.3")
@pytest.mark.parametrize("device_path", [True, False], ids=["device", "cpu"])
@pytest.mark.parametrize("clip", [False, True], ids=["scaled", "unscale_-then-clip"])
def test_grad_scaler_steps_bitwise_and_skips_infs(fresh_daemon, device_path, clip):
    """Under a GradScaler, OffloadAdamW unscales the gradients it steps with (on the
    device path, the copies made during backward: GradScaler leaves the gradients
    scaled for it), skips a step whose gradients hold an inf, and matches torch's
    AdamW under the same scaler bitwise; an unscale_ before clipping is seen too."""
    torch.set_num_threads(1)
    plain = _model()
    reference = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    ours = copy.deepcopy(plain)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) for _ in range(2)]
    if device_path:
        copies = SimulatedCopies(delay_s=0.002)
        _device_run(fresh_daemon.socket, ours, copies, clip=clip, scaler=scalers[1], inf_at=2)
        # The hooks' copies of every micro-batch, and again at each step that is not
        # skipped when unscale_ and clipping changed the gradients since.
        copied = STEPS * MICRO + (STEPS - 1) * clip if HOOKS else STEPS - 1
        assert copies.bytes_to_host == copied * _bytes(ours)
        assert copies.bytes_to_device == (STEPS - 1) * _bytes(ours)  # one step skipped
    else:
        stash = actstash.connect(fresh_daemon.socket)
        try:
            opt = OffloadAdamW(ours.parameters(), stash=stash, lr=3e-3, weight_decay=0.1)
            _train_steps(ours, opt, STEPS, clip=clip, scaler=scalers[1], inf_at=2)
        finally:
            stash.close()
    _train_steps(plain, reference, STEPS, clip=clip, scaler=scalers[0], inf_at=2)
    assert scalers[0].get_scale() == scalers[1].get_scale() < 2.0 ** 12  # the inf step
    for a, b in zip(plain.parameters(), ours.parameters()):
        assert torch.equal(a, b)


def test_device_path_refuses_low_precision_fraction_with_nothing_kept(fresh_daemon):
    model = _low_precision_model(torch.bfloat16)
    stash = actstash.connect(fresh_daemon.socket)
    copies = SimulatedCopies()
    try:
        with pytest.raises(ValueError, match="fraction < 1"):
            OffloadAdamW(model.parameters(), stash=stash, fraction=0.5, _copies=copies)
        assert stash.stats()["optimizer_state_bytes"] == 0
    finally:
        copies.close()
        stash.close()
