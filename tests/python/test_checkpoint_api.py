"""actstash.checkpoint's torch-compatible API: keyword tensor inputs are offloaded
like positional ones, torch.utils.checkpoint's keywords (use_reentrant,
preserve_rng_state, context_fn, determinism_check) are consumed by checkpoint
rather than passed to the function, and wrap() offloads blocks called with
keyword activations. Gradients are compared bitwise with plain autograd (and
with torch.utils.checkpoint where torch 1.13 has the feature) on the same seed;
stats show the boundary tensors really went to the daemon and came back."""
import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import actstash
from actstash_testing.training import assert_bitwise

torch.set_num_threads(1)

_COUNTERS = ("tensors_offloaded", "bytes_offloaded", "tensors_fetched", "bytes_fetched",
             "tensors_kept", "live_tensors", "live_bytes", "kept_keep_listed")


def counters(stash):
    stats = stash.stats()
    return {k: stats[k] for k in _COUNTERS}


def delta(before, after):
    return {k: after[k] - before[k] for k in _COUNTERS}


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


class KwBlock(nn.Module):
    """forward(x, gate=None, scale=1.0): tensors by position or keyword."""

    def __init__(self, dim=256, dropout=0.0):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, gate=None, scale=1.0):
        h = self.drop(nn.functional.gelu(self.fc(self.ln(x))))
        if gate is not None:
            h = h * torch.sigmoid(gate)
        return x + scale * h


def run_block(call, dropout=0.0, seed=0, stash=None):
    """Builds a KwBlock and its inputs from `seed`, runs call(block, x, gate) and a
    backward; returns (gradients of the parameters and of the input leaves, stats
    deltas of the forward, stats deltas of the backward, the boundary tensors)."""
    torch.manual_seed(seed)
    block = KwBlock(dropout=dropout)
    x0 = torch.randn(64, 256, requires_grad=True)
    g0 = torch.randn(256, requires_grad=True)
    x, gate = x0 * 2, g0 + 1  # not leaves: offloadable at the boundary
    before = counters(stash) if stash else None
    out = call(block, x, gate)
    middle = counters(stash) if stash else None
    if stash:
        stash.synchronize()  # stores done: backward reads the daemon's bytes
    out.square().sum().backward()
    after = counters(stash) if stash else None
    grads = [p.grad.clone() for p in block.parameters()]
    grads += [t.grad.clone() if t.grad is not None else torch.zeros(()) for t in (x0, g0)]
    fwd = delta(before, middle) if stash else None
    bwd = delta(middle, after) if stash else None
    return grads, fwd, bwd, (x, gate)


def test_keyword_tensor_is_offloaded_and_gradients_are_bitwise_equal(stash):
    expected, _, _, _ = run_block(lambda b, x, g: b(x=x))
    actual, fwd, bwd, (x, _) = run_block(
        lambda b, x, g: actstash.checkpoint(b, x=x, stash=stash, min_bytes=0), stash=stash)
    assert_bitwise(expected, actual)
    assert fwd["tensors_offloaded"] == 1, fwd
    assert fwd["bytes_offloaded"] == nbytes(x) == 64 * 256 * 4, fwd
    assert fwd["live_bytes"] == nbytes(x), "held by the daemon until recomputation"
    assert bwd["tensors_fetched"] == 1 and bwd["bytes_fetched"] == nbytes(x), bwd
    assert bwd["live_bytes"] == -nbytes(x), "released once recomputation read it"


def test_positional_and_keyword_tensors_are_both_offloaded(stash):
    expected, _, _, _ = run_block(lambda b, x, g: b(x, gate=g, scale=0.5))
    actual, fwd, bwd, (x, gate) = run_block(
        lambda b, x, g: actstash.checkpoint(b, x, gate=g, scale=0.5, stash=stash, min_bytes=0),
        stash=stash)
    assert_bitwise(expected, actual)
    assert fwd["tensors_offloaded"] == 2, fwd
    assert fwd["bytes_offloaded"] == nbytes(x, gate) == (64 * 256 + 256) * 4, fwd
    assert bwd["tensors_fetched"] == 2 and bwd["bytes_fetched"] == nbytes(x, gate), bwd


def test_all_keyword_inputs_are_offloaded(stash):
    expected, _, _, _ = run_block(lambda b, x, g: b(gate=g, x=x))
    actual, fwd, bwd, (x, gate) = run_block(
        lambda b, x, g: actstash.checkpoint(b, gate=g, x=x, stash=stash, min_bytes=0), stash=stash)
    assert_bitwise(expected, actual)
    assert fwd["tensors_offloaded"] == 2 and fwd["bytes_offloaded"] == nbytes(x, gate), fwd
    assert bwd["tensors_fetched"] == 2 and bwd["bytes_fetched"] == nbytes(x, gate), bwd


def test_use_reentrant_false_is_not_passed_to_the_function(stash):
    calls = []

    def only_x(block):
        def f(x):  # takes x only: use_reentrant must not reach it
            calls.append(x.shape)
            return block(x)
        return f

    expected, _, _, _ = run_block(lambda b, x, g: b(x))
    actual, fwd, bwd, (x, _) = run_block(
        lambda b, x, g: actstash.checkpoint(only_x(b), x, use_reentrant=False, stash=stash,
                                            min_bytes=0),
        stash=stash)
    assert_bitwise(expected, actual)
    assert len(calls) == 2, "forward and recomputation"
    assert fwd["tensors_offloaded"] == 1 and fwd["bytes_offloaded"] == nbytes(x), fwd
    assert bwd["tensors_fetched"] == 1 and bwd["bytes_fetched"] == nbytes(x), bwd


def test_use_reentrant_true_is_refused(stash):
    def f(x):
        raise AssertionError("must not run")

    before = counters(stash)
    x = torch.randn(64, 256).requires_grad_() * 1
    with pytest.raises(ValueError, match=r"use_reentrant=True is not supported"):
        actstash.checkpoint(f, x, use_reentrant=True, stash=stash, min_bytes=0)
    assert delta(before, counters(stash))["tensors_offloaded"] == 0


def test_preserve_rng_state_false_is_accepted_and_matches_torch_checkpoint(stash):
    # Without preserving the RNG state, dropout in the recomputation draws a fresh
    # mask: torch's non-reentrant checkpoint and ours draw the same one.
    theirs, _, _, _ = run_block(
        lambda b, x, g: torch_checkpoint(b, x, use_reentrant=False, preserve_rng_state=False),
        dropout=0.5)
    ours, fwd, bwd, (x, _) = run_block(
        lambda b, x, g: actstash.checkpoint(b, x, use_reentrant=False, preserve_rng_state=False,
                                            stash=stash, min_bytes=0),
        dropout=0.5, stash=stash)
    assert_bitwise(theirs, ours)
    plain, _, _, _ = run_block(lambda b, x, g: b(x), dropout=0.5)
    assert not torch.equal(plain[0], ours[0]), "the flag took effect: a different mask"
    assert fwd["tensors_offloaded"] == 1 and fwd["bytes_offloaded"] == nbytes(x), fwd
    assert bwd["tensors_fetched"] == 1 and bwd["bytes_fetched"] == nbytes(x), bwd


def test_dropout_with_preserved_rng_state_matches_torch_checkpoint_and_plain_autograd(stash):
    plain, _, _, _ = run_block(lambda b, x, g: b(x, gate=g), dropout=0.5)
    theirs, _, _, _ = run_block(
        lambda b, x, g: torch_checkpoint(b, x, g, use_reentrant=False, preserve_rng_state=True),
        dropout=0.5)
    ours, fwd, bwd, (x, gate) = run_block(
        lambda b, x, g: actstash.checkpoint(b, x, gate=g, use_reentrant=False,
                                            preserve_rng_state=True, stash=stash, min_bytes=0),
        dropout=0.5, stash=stash)
    assert_bitwise(plain, theirs)
    assert_bitwise(plain, ours)
    assert fwd["tensors_offloaded"] == 2 and fwd["bytes_offloaded"] == nbytes(x, gate), fwd
    assert bwd["tensors_fetched"] == 2 and bwd["bytes_fetched"] == nbytes(x, gate), bwd


def test_context_fn_forward_and_recompute_contexts(stash):
    log = []
    active = [None]

    @contextlib.contextmanager
    def recording(name):
        log.append(("enter", name))
        active[0] = name
        try:
            yield
        finally:
            active[0] = None
            log.append(("exit", name))

    def context_fn():
        return recording("forward"), recording("recompute")

    def traced(block):
        def f(x, gate=None):
            log.append(("call", active[0]))
            return block(x, gate=gate)
        return f

    plain, _, _, _ = run_block(lambda b, x, g: b(x, gate=g), dropout=0.5)
    calls_before_backward = []

    def call(b, x, g):
        out = actstash.checkpoint(traced(b), x, gate=g, context_fn=context_fn, stash=stash,
                                  min_bytes=0)
        calls_before_backward.extend(log)
        return out

    ours, fwd, bwd, (x, gate) = run_block(call, dropout=0.5, stash=stash)
    assert calls_before_backward == [("enter", "forward"), ("call", "forward"),
                                     ("exit", "forward")]
    assert log == [("enter", "forward"), ("call", "forward"), ("exit", "forward"),
                   ("enter", "recompute"), ("call", "recompute"), ("exit", "recompute")]
    assert_bitwise(plain, ours)
    assert fwd["tensors_offloaded"] == 2 and fwd["bytes_offloaded"] == nbytes(x, gate), fwd
    assert bwd["tensors_fetched"] == 2 and bwd["bytes_fetched"] == nbytes(x, gate), bwd


def _shape_changing_function():
    """x * c where c (saved for x's gradient) is (4, 8) on the first call and (1, 8)
    afterwards: the recomputation saves a tensor of another shape, and the gradient
    (c broadcast over x) is the same."""
    calls = [0]

    def f(x):
        calls[0] += 1
        c = torch.full((4, 8) if calls[0] == 1 else (1, 8), 2.0)
        return x * c

    return f, calls


def test_determinism_check_default_raises_when_recomputation_saves_other_shapes(stash):
    f, calls = _shape_changing_function()
    x = torch.randn(4, 8, requires_grad=True) * 1
    out = actstash.checkpoint(f, x, determinism_check="default", stash=stash, min_bytes=0)
    with pytest.raises(RuntimeError, match=r"recomputed values differ in metadata from the "
                                           r"forward pass \(saved tensor 0: recomputed "
                                           r"\(\(1, 8\), torch\.float32, device\(type='cpu'\)\), "
                                           r"forward \(\(4, 8\), torch\.float32, "
                                           r"device\(type='cpu'\)\)\); pass "
                                           r"determinism_check='none' to skip this check"):
        out.sum().backward()
    assert calls[0] == 2


def test_determinism_check_is_on_by_default(stash):
    f, _ = _shape_changing_function()
    x = torch.randn(4, 8, requires_grad=True) * 1
    out = actstash.checkpoint(f, x, stash=stash, min_bytes=0)
    with pytest.raises(RuntimeError, match=r"recomputed values differ in metadata"):
        out.sum().backward()


def test_determinism_check_none_accepts_other_shapes(stash):
    f, calls = _shape_changing_function()
    torch.manual_seed(0)
    x0 = torch.randn(64, 8, requires_grad=True)
    x = (x0 * 1)[:4]
    # 4x8 floats is 128 bytes: offloaded too (min_bytes=0).
    before = counters(stash)
    out = actstash.checkpoint(f, x, determinism_check="none", stash=stash, min_bytes=0)
    stash.synchronize()
    out.sum().backward()
    d = delta(before, counters(stash))
    assert calls[0] == 2
    assert d["tensors_offloaded"] == 1 and d["tensors_fetched"] == 1, d

    torch.manual_seed(0)
    y0 = torch.randn(64, 8, requires_grad=True)
    ((y0 * 1)[:4] * torch.full((4, 8), 2.0)).sum().backward()
    assert torch.equal(x0.grad, y0.grad)


def test_determinism_check_invalid_value_is_refused(stash):
    def f(x):
        raise AssertionError("must not run")

    with pytest.raises(ValueError, match=r"determinism_check should be one of \['default', "
                                         r"'none'\], but got strict"):
        actstash.checkpoint(f, torch.randn(4), determinism_check="strict", stash=stash, min_bytes=0)


class HiddenStatesBlock(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        self.inner = KwBlock(dim, dropout=0.1)

    def forward(self, hidden_states, attention_scale=1.0):
        return self.inner(hidden_states, scale=attention_scale)


class HiddenStatesModel(nn.Module):
    def __init__(self, layers=3, dim=256):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([HiddenStatesBlock(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(hidden_states=h, attention_scale=0.5)
        return self.head(h)


def _train_hidden_states_model(stash=None):
    torch.manual_seed(0)
    model = HiddenStatesModel()
    x = torch.randn(64, 256)
    if stash is not None:
        actstash.wrap(model, stash, blocks=HiddenStatesBlock, mode="checkpoint+offload",
                      min_bytes=0)
    before = counters(stash) if stash else None
    loss = model(x).logsumexp(1).mean()
    middle = counters(stash) if stash else None
    if stash:
        stash.synchronize()
    loss.backward()
    after = counters(stash) if stash else None
    grads = [p.grad.clone() for p in model.parameters()]
    if stash:
        return grads, delta(before, middle), delta(middle, after)
    return grads, None, None


def test_wrap_offloads_blocks_called_with_keyword_activations(stash):
    expected, _, _ = _train_hidden_states_model()
    actual, fwd, bwd = _train_hidden_states_model(stash)
    assert_bitwise(expected, actual)
    per_block = 64 * 256 * 4
    assert fwd["tensors_offloaded"] == 3, fwd
    assert fwd["bytes_offloaded"] == 3 * per_block, fwd
    assert fwd["kept_keep_listed"] == 0, fwd
    assert bwd["tensors_fetched"] == 3 and bwd["bytes_fetched"] == 3 * per_block, bwd


def _autocast_block(x, w):
    return torch.nn.functional.gelu(x @ w).sum(dim=-1)


def _grads_under_cpu_autocast(run):
    torch.manual_seed(3)
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(128, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run(x, w)
    assert y.dtype == torch.bfloat16  # autocast was on in forward
    y.float().sum().backward()
    return x.grad, w.grad


def test_recomputation_replays_cpu_autocast_like_torch_checkpoint(stash):
    expected = _grads_under_cpu_autocast(
        lambda x, w: torch_checkpoint(_autocast_block, x * 2, w, use_reentrant=False))
    before = stash.stats()["tensors_offloaded"]
    actual = _grads_under_cpu_autocast(
        lambda x, w: actstash.checkpoint(_autocast_block, x * 2, w, stash=stash, min_bytes=0))
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert stash.stats()["tensors_offloaded"] > before


def test_autocast_state_uses_the_per_device_api_where_torch_has_it(monkeypatch):
    """torch >= 2.4 deprecates the per-kind getters (get_autocast_gpu_dtype, ...) for
    get_autocast_dtype(device_type) and is_autocast_enabled(device_type); this torch
    may have either, so the newer branch runs here against a stand-in of that API."""
    from actstash._hooks import _checkpoint
    calls = []
    monkeypatch.setattr(torch, "get_autocast_dtype",
                        lambda device: calls.append(("dtype", device)) or torch.float16,
                        raising=False)
    monkeypatch.setattr(torch, "is_autocast_enabled",
                        lambda *device: calls.append(("enabled",) + device) or True)
    state = _checkpoint._autocast_kwargs("cuda")
    assert state["enabled"] is True and state["dtype"] is torch.float16
    assert calls == [("enabled", "cuda"), ("dtype", "cuda")]
