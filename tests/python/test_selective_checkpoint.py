"""actstash.checkpoint with torch 2.x's checkpoint keywords: selective activation
checkpointing (SAC) whose saved tensors go to the stash, early_stop, and
respect_saved_tensors_hooks. Gradients are compared bitwise with plain autograd and
torch.utils.checkpoint on the same seed; stats show what the SAC policy saved went to
the daemon and came back; wrap(mode="selective"), the peers' SAC per block. SAC
needs torch >= 2.3 and the routing of what it caches through hooks torch >= 2.14
(respect_saved_tensors_hooks): skipped where absent."""
import functools
import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.utils import checkpoint as torch_cp
try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # torch 1.x
    TorchDispatchMode = object

import actstash
from actstash_testing.training import assert_bitwise

torch.set_num_threads(1)

HAS_SAC = hasattr(torch_cp, "create_selective_checkpoint_contexts")
SAC_ROUTES = HAS_SAC and "respect_saved_tensors_hooks" in inspect.signature(
    torch_cp.checkpoint).parameters
needs_sac_routing = pytest.mark.skipif(
    not SAC_ROUTES, reason=f"torch {torch.__version__} has no respect_saved_tensors_hooks "
    "(SAC's cached tensors cannot reach saved-tensor hooks)")
DIM, ROWS = 256, 64
LINEAR_OUT = ROWS * DIM * 4  # bytes of one fp32 Linear output


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)

    def forward(self, x):
        # Both Linear outputs are read by backward (gelu saves its input): what SAC
        # caches of them is consumed by the recomputation, none left unread.
        gelu = nn.functional.gelu
        return x + gelu(self.fc2(gelu(self.fc1(self.ln(x)))))


def save_linear_outputs(decisions):
    """A SAC policy: Linear outputs (addmm/mm) are saved, the rest recomputed;
    `decisions` counts the forward's saves."""
    aten = torch.ops.aten

    def policy(ctx, op, *args, **kwargs):
        if op in (aten.addmm.default, aten.mm.default):
            if not ctx.is_recompute:
                decisions.append(op)
            return torch_cp.CheckpointPolicy.MUST_SAVE
        return torch_cp.CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(torch_cp.create_selective_checkpoint_contexts, policy)


def run(call, stash=None):
    """Block and input from seed 0; call(block, x) then backward. Returns the
    gradients and the stats deltas of forward and backward."""
    torch.manual_seed(0)
    block = Block()
    x0 = torch.randn(ROWS, DIM, requires_grad=True)
    x = x0 * 2  # not a leaf: the boundary is offloadable
    before = stash.stats() if stash else None
    out = call(block, x)
    middle = stash.stats() if stash else None
    if stash:
        stash.synchronize()
    out.square().sum().backward()
    after = stash.stats() if stash else None
    grads = [p.grad.clone() for p in block.parameters()] + [x0.grad.clone()]

    def delta(a, b):
        return {k: b[k] - a[k] for k in ("bytes_offloaded", "bytes_fetched", "live_bytes")}

    return grads, (delta(before, middle) if stash else None), (delta(middle, after)
                                                               if stash else None)


@pytest.fixture
def stash(daemon):
    s = actstash.connect(daemon.socket)
    yield s
    s.close()


@needs_sac_routing
def test_what_sac_saves_goes_to_the_stash(stash):
    plain, _, _ = run(lambda b, x: b(x))
    decisions = []
    sac = save_linear_outputs(decisions)
    torch_sac, _, _ = run(lambda b, x: torch_cp.checkpoint(b, x, use_reentrant=False,
                                                           context_fn=sac))
    assert_bitwise(plain, torch_sac)

    decisions.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # nothing to choose: it goes to the stash
        routed, fwd, bwd = run(lambda b, x: actstash.checkpoint(b, x, stash=stash, context_fn=sac),
                               stash)
    assert_bitwise(plain, routed)
    saved = len(decisions) * LINEAR_OUT
    assert len(decisions) == 2
    # The boundary input and both Linear outputs went to the daemon and came back.
    assert fwd["bytes_offloaded"] == ROWS * DIM * 4 + saved, fwd
    assert bwd["bytes_fetched"] == fwd["bytes_offloaded"], bwd
    assert fwd["live_bytes"] + bwd["live_bytes"] == 0

    # Opting out keeps what SAC saves in the trainer, as torch does by default.
    decisions.clear()
    kept, fwd_kept, _ = run(lambda b, x: actstash.checkpoint(
        b, x, stash=stash, context_fn=sac, respect_saved_tensors_hooks=False), stash)
    assert_bitwise(plain, kept)
    assert fwd_kept["bytes_offloaded"] == ROWS * DIM * 4, fwd_kept


@needs_sac_routing
def test_sac_inside_an_offload_scope_follows_torchs_rule(stash):
    """No stash= given: the hooks around the checkpoint (stash.offload's) see what SAC
    saves only when asked, as with torch.utils.checkpoint; actstash's own hooks are
    internal, so without a scope around there is nothing to warn about."""
    plain, _, _ = run(lambda b, x: b(x))
    sac = save_linear_outputs([])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        alone, _, _ = run(lambda b, x: actstash.checkpoint(b, x, context_fn=sac))
    assert_bitwise(plain, alone)

    def scoped(respect):
        def call(b, x):
            with stash.offload(min_bytes=0):
                return actstash.checkpoint(b, x, context_fn=sac,
                                           respect_saved_tensors_hooks=respect)
        return run(call, stash)

    grads, fwd, bwd = scoped(True)
    assert_bitwise(plain, grads)
    # The two Linear outputs through the scope's hooks (the input stays: no stash=,
    # nothing of the checkpoint's own is stored) and back.
    assert fwd["bytes_offloaded"] == 2 * LINEAR_OUT, fwd
    assert bwd["bytes_fetched"] == fwd["bytes_offloaded"]
    grads, fwd, _ = scoped(False)
    assert_bitwise(plain, grads)
    assert fwd["bytes_offloaded"] == 0, fwd
    with pytest.warns(FutureWarning, match="respect_saved_tensors_hooks"):
        scoped(None)  # torch's default: it asks the user to choose


def test_early_stop_skips_the_rest_of_the_recomputation(stash):
    """The recomputation stops once every saved tensor is back (torch's default);
    early_stop=False, or torch's set_checkpoint_early_stop(False), runs it to the end.
    The keywords are checkpoint's own: the function never sees them."""
    calls = []

    def fn(x, **kwargs):
        assert not kwargs, kwargs
        calls.append("start")
        y = x.exp()  # saves its output
        calls.append("end")
        return y + 1  # saves nothing

    def once(**kw):
        calls.clear()
        torch.manual_seed(0)
        x = torch.randn(ROWS, DIM, requires_grad=True)
        actstash.checkpoint(fn, x * 1, stash=stash, **kw).sum().backward()
        return list(calls), x.grad

    (stopped, g1), (full, g2) = once(), once(early_stop=False)
    assert stopped == ["start", "end", "start"]
    assert full == ["start", "end", "start", "end"]
    _, g3 = once(respect_saved_tensors_hooks=False, use_reentrant=False)
    assert torch.equal(g1, g2) and torch.equal(g1, g3)
    if hasattr(torch_cp, "set_checkpoint_early_stop"):
        with torch_cp.set_checkpoint_early_stop(False):
            assert once()[0] == full
        calls.clear()
        x = torch.randn(ROWS, DIM, requires_grad=True)
        torch_cp.checkpoint(fn, x * 1, use_reentrant=False).sum().backward()
        assert calls == stopped  # as torch does


class _CountAddmm(TorchDispatchMode):
    """Counts the aten.addmm calls (Linear forwards) made while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.addmm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not HAS_SAC, reason=f"torch {torch.__version__} has no SAC")
@pytest.mark.parametrize("mode", ["selective", "checkpoint+offload"])
def test_wrap_selective_recomputes_only_the_cheap_ops(stash, mode):
    """wrap(mode="selective"): the Linear outputs are saved (their addmm is not run
    again in backward, as checkpoint+offload runs it), the rest recomputed, the block's
    input offloaded; on a torch that routes what SAC saves through hooks (>= 2.14) the
    Linear outputs go to the stash too. Gradients bitwise those of plain autograd."""
    def model_and_input():
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block())
        x = torch.randn(ROWS, DIM, requires_grad=True)
        return model, x

    model, x = model_and_input()
    model(x * 2).square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    model, x = model_and_input()
    actstash.wrap(model, stash, blocks=Block, mode=mode)
    before = stash.stats()
    out = model(x * 2)
    forward = stash.stats()
    counter = _CountAddmm()
    with counter:
        out.square().sum().backward()
    after = stash.stats()
    assert_bitwise(plain, [p.grad.clone() for p in model.parameters()] + [x.grad.clone()])
    offloaded = forward["bytes_offloaded"] - before["bytes_offloaded"]
    inputs = 2 * ROWS * DIM * 4  # each block's input
    if mode == "selective":
        assert counter.count == 0  # no Linear forward run again
        saved_too = SAC_ROUTES  # what SAC saves: to the stash, or kept in the trainer
        assert offloaded == inputs + (4 * LINEAR_OUT if saved_too else 0), forward
    else:
        assert counter.count == 4  # two Linears per block, run again
        assert offloaded == inputs, forward
    assert after["bytes_fetched"] - before["bytes_fetched"] == offloaded, after
    actstash.unwrap(model)


def test_wrap_selective_without_sac_is_refused_clearly(stash, monkeypatch):
    monkeypatch.delattr(torch_cp, "create_selective_checkpoint_contexts", raising=False)
    with pytest.raises(ValueError, match="selective activation checkpointing"):
        actstash.wrap(nn.Sequential(Block()), stash, blocks=Block, mode="selective")
