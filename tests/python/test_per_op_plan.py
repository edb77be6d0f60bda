"""The per-op plan's mechanism (_plan/_selective): inside a checkpointed block each
op's output is kept, offloaded or recomputed by its position. Gradients are compared
bitwise with plain autograd on the same seed (with and without an injected copy
delay); stats show that what the plan offloads went to the daemon and came back;
the op profile finds what may be saved and what costs most to recompute. Needs
torch >= 2.4 (the SAC generation); skipped before."""
import pytest
import torch
from torch import nn

import actstash
from actstash._plan import _selective
from actstash_testing.training import assert_bitwise

pytestmark = pytest.mark.skipif(not _selective.supported(),
                                reason=f"torch {torch.__version__} has no selective "
                                "activation checkpointing (torch >= 2.4)")
torch.set_num_threads(1)
DIM, ROWS = 256, 64
OUT = ROWS * DIM * 4  # bytes of one fp32 Linear output (and of the block's input)


class Block(nn.Module):
    def __init__(self, inplace=False):
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        self.inplace = inplace

    def forward(self, x):
        h = self.fc1(self.ln(x))
        h = h.relu_() if self.inplace else nn.functional.gelu(h)
        return x + nn.functional.gelu(self.fc2(h))


def profile(block_args=()):
    """The block's ops as OpRecorder records them in a recomputation."""
    torch.manual_seed(0)
    block = Block(*block_args)
    x = torch.randn(ROWS, DIM, requires_grad=True) * 2
    recorder = _selective.OpRecorder(cuda=False)
    out = actstash.checkpoint(block, x, context_fn=recorder.context_fn(), min_bytes=0)
    out.square().sum().backward()
    return recorder.ops


def positions_of(ops, names):
    return {i for i, op in enumerate(ops) if op[0] in names}


def run(choices_of=None, stash=None, block_args=()):
    """Block and input from seed 0, through checkpoint with the per-op context (None:
    plain autograd), then backward. Returns the gradients and the stats deltas of the
    forward and of the backward."""
    torch.manual_seed(0)
    block = Block(*block_args)
    x0 = torch.randn(ROWS, DIM, requires_grad=True)
    x = x0 * 2
    before = stash.stats() if stash else None
    if choices_of is None:
        out = block(x)
    else:
        out = actstash.checkpoint(block, x, stash=stash, min_bytes=0, context_fn=(
            _selective.context_fn(choices_of, stash, 0)))
    middle = stash.stats() if stash else None
    if stash:
        stash.synchronize()
    out.square().sum().backward()
    after = stash.stats() if stash else None
    grads = [p.grad.clone() for p in block.parameters()] + [x0.grad.clone()]
    if not stash:
        return grads, None, None

    def delta(a, b):
        return {k: b[k] - a[k] for k in ("bytes_offloaded", "bytes_fetched", "live_bytes")}
    return grads, delta(before, middle), delta(middle, after)


def test_the_profile_finds_what_may_be_saved():
    ops = profile()
    names = [op[0] for op in ops]
    assert names.count("addmm") == 2, names
    for op in ops:
        assert op[2] >= 0
        if op[0] in ("t", "view", "transpose", "expand"):
            assert not op[3], op  # views are never saved
    linear = positions_of(ops, {"addmm"})
    assert all(ops[i][1] == OUT and ops[i][3] for i in linear)
    saved, nbytes, share = _selective.choose_saved(ops)
    # Which ones are saved turns on one run's op times (a loaded machine can make
    # a gelu look slower than a matmul): only that some are, and what they hold.
    assert saved and all(ops[i][3] for i in saved), (saved, ops)
    assert nbytes == sum(ops[i][1] for i in saved) and 0 < share < 1


def test_the_rule_saves_what_costs_more_than_average_per_byte():
    # name, bytes, seconds, may be saved: two matmuls (slow per byte), an
    # element-wise op (fast), a view and a random op (never saved).
    ops = [["addmm", 1000, 1.0, True], ["gelu", 1000, 0.1, True], ["t", 4000, 0.0, False],
           ["addmm", 2000, 1.5, True], ["native_dropout", 1000, 0.5, False]]
    saved, nbytes, share = _selective.choose_saved(ops)
    assert saved == [0, 3] and nbytes == 3000
    assert share == pytest.approx(2.5 / 3.1)
    assert _selective.choose_saved([]) == ([], 0, 0.0)


def test_an_output_changed_in_place_is_never_saved():
    ops = profile((True,))
    relu = [op for op in ops if op[0] == "relu_"]
    assert relu and not relu[0][3]  # in place
    first_linear = min(positions_of(ops, {"addmm"}))
    assert not ops[first_linear][3], ops[first_linear]  # relu_ changed it afterwards
    saved, _, _ = _selective.choose_saved(ops)
    assert first_linear not in saved


@pytest.mark.parametrize("kind", ["keep", "offload", "mixed"])
def test_each_choice_trains_bitwise(stash, kind):
    """stash: the conftest's, with and without a 300 us copy delay."""
    plain, _, _ = run()
    ops = profile()
    linear = sorted(positions_of(ops, {"addmm"}))
    choices = {"keep": {i: _selective.KEEP for i in linear},
               "offload": {i: _selective.OFFLOAD for i in linear},
               "mixed": {linear[0]: _selective.OFFLOAD, linear[1]: _selective.KEEP}}[kind]
    grads, fwd, bwd = run(choices, stash)
    assert_bitwise(plain, grads)
    offloaded = sum(OUT for c in choices.values() if c == _selective.OFFLOAD)
    # The boundary input and the offloaded Linear outputs went to the daemon and came back.
    assert fwd["bytes_offloaded"] == OUT + offloaded, fwd
    assert bwd["bytes_fetched"] == fwd["bytes_offloaded"], bwd
    assert fwd["live_bytes"] + bwd["live_bytes"] == 0


def test_recomputing_every_op_is_checkpoint(stash):
    plain, _, _ = run()
    grads, fwd, _ = run({}, stash)
    assert_bitwise(plain, grads)
    assert fwd["bytes_offloaded"] == OUT


def test_a_kept_output_changed_in_place_afterwards_is_made_again(stash):
    """A plan that keeps an output the block later changes in place (the profile
    would not pick it; a plan from another path might): the recomputation sees the
    change (its version, as torch's SAC checks) and makes it again from the
    recomputed inputs: bitwise."""
    plain, _, _ = run(block_args=(True,))
    ops = profile((True,))
    first_linear = min(positions_of(ops, {"addmm"}))
    grads, _, _ = run({first_linear: _selective.KEEP}, stash, (True,))
    assert_bitwise(plain, grads)


def test_an_output_changed_in_place_after_its_tensor_is_gone_is_never_saved():
    """nn.Sequential(Linear, ReLU(inplace=True), Linear): the first Linear's output is
    changed in place where no frame of the block keeps its tensor; the profile marks it
    (it sees the in-place write itself, as well as versions at its end)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(inplace=True), nn.Linear(DIM, DIM))
    recorder = _selective.OpRecorder(cuda=False)
    x = torch.randn(ROWS, DIM, requires_grad=True) * 2
    actstash.checkpoint(block, x, context_fn=recorder.context_fn(), min_bytes=0).sum().backward()
    linear = min(i for i, op in enumerate(recorder.ops) if op[0] == "addmm")
    assert not recorder.ops[linear][3], recorder.ops
    saved, _, _ = _selective.choose_saved(recorder.ops)
    assert linear not in saved


def test_dropout_is_never_saved():
    """A skipped draw would shift every later one in the recomputation."""
    torch.manual_seed(0)
    drop = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.5), nn.Linear(DIM, DIM))
    recorder = _selective.OpRecorder(cuda=False)
    x = torch.randn(ROWS, DIM, requires_grad=True) * 2
    actstash.checkpoint(drop, x, context_fn=recorder.context_fn()).sum().backward()
    random = [op for op in recorder.ops if "dropout" in op[0] or "bernoulli" in op[0]]
    assert random and not any(op[3] for op in random), recorder.ops


def _gpt():
    from gpt import GPT
    torch.manual_seed(0)
    return GPT(vocab=64, dim=64, heads=2, layers=3, context=32)  # dropout 0.1


def test_auto_runs_the_selective_choices_bitwise(stash):
    """wrap(policy="auto") profiles each block's ops, then its plan may save a block's
    costliest outputs in the trainer (selective) or the stash (selective+offload) and
    recompute the rest. Such a plan, set here, trains bitwise against plain autograd,
    and what it offloads per step is what its costs say: each selective+offload
    block's input and saved outputs."""
    import copy
    from gpt import loss_fn
    from actstash._plan import _planner
    model = _gpt()
    plain = copy.deepcopy(model)
    batches = [torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(k))
               for k in range(5)]

    def step(m, k):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(100 + k)
        loss_fn(m, batches[k]).backward()
        return [p.grad.clone() for p in m.parameters()]

    actstash.wrap(model, stash, policy="auto", budget="1GiB", min_bytes=0, candidates=1)
    for k in range(2):  # the op profile, then the measured profile
        assert_bitwise(step(plain, k), step(model, k))
    report = stash.plan()
    entry = model._actstash_planner.current
    assert report.machine.selective_allowed and entry.ops
    for cost, positions in zip(report.costs, entry.selective):
        assert positions and cost.selective_bytes > 0
        assert 0 < cost.selective_recompute_s < cost.recompute_s
    choices = [_planner.SELECTIVE_OFFLOAD, _planner.SELECTIVE, _planner.SELECTIVE_OFFLOAD]
    entry.plan = _planner.Plan(choices=choices, budget=entry.budget,
                               prediction=_planner.simulate(report.costs, report.machine,
                                                            choices))
    entry.verify = False
    expected = sum(c.input_offload_bytes + c.selective_offload_bytes
                   for c, choice in zip(report.costs, choices)
                   if choice == _planner.SELECTIVE_OFFLOAD)
    for k in range(2, 5):
        before = stash.stats()
        grads = step(model, k)
        stash.synchronize()
        after = stash.stats()
        assert_bitwise(step(plain, k), grads)
        assert after["bytes_offloaded"] - before["bytes_offloaded"] == expected, (after, before)
        d = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
        # Each came back: fetched, or served by its source while its store was in flight.
        assert d["tensors_fetched"] + d["unpacked_from_source"] == d["tensors_offloaded"], d
        assert 0 < d["bytes_fetched"] <= expected, d
        assert after["live_bytes"] == 0
    assert stash.plan().choices == choices
    actstash.unwrap(model)
