"""Offload and checkpoint against plain autograd: parameter gradients must be
bitwise equal, on the same seed, with and without injected copy delays."""
import gc

import pytest
import torch
from torch import nn

import actstash
from gpt import GPT, loss_fn

torch.set_num_threads(1)


class Weird(nn.Module):
    """Saved tensors that are views, transposes, strided slices with gaps,
    broadcasts, and results of in-place ops."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 96)
        self.scale = nn.Parameter(torch.randn(96))

    def forward(self, x):
        h = self.lin(x)                        # (32, 96)
        t = h.t()                              # transpose view
        gaps = torch.sigmoid(h)[:, ::3]        # strided slice with gaps
        z = gaps * gaps.exp()
        r = h.clone()
        r.relu_()                              # in-place: saves its result
        wide = h.unsqueeze(0).expand(4, -1, -1)  # broadcast, stride 0
        b = wide * torch.randn(4, 1, 96)
        m = t @ torch.tanh(h)                  # saves the transposed view
        return z.sum() + (r * self.scale).sum() + b.sum() + m.sum() + (t * t).mean()


def mlp():
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 128),
                         nn.LayerNorm(128), nn.Linear(128, 10))


def gpt():
    return GPT(vocab=256, dim=64, heads=4, layers=3, context=32, dropout=0.1)


MODELS = {
    "mlp": (mlp, lambda: torch.randn(32, 128), lambda m, x: m(x).logsumexp(1).mean()),
    "gpt": (gpt, lambda: torch.randint(0, 256, (4, 33)), loss_fn),
    "weird": (Weird, lambda: torch.randn(32, 64), lambda m, x: m(x)),
}


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def run(kind, steps=1, prepare=None, ctx=None, seed=0):
    """Builds the model and data from `seed`, runs `steps` forward+backward under
    `ctx` (a callable giving a context manager) and returns the gradients."""
    make, data, loss = MODELS[kind]
    torch.manual_seed(seed)
    model = make()
    x = data()
    if prepare is not None:
        prepare(model)
    for _ in range(steps):
        with (ctx() if ctx else _null()):
            value = loss(model, x)
        value.backward()
    return grads(model)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_bitwise(expected, actual):
    assert len(expected) == len(actual)
    for i, (a, b) in enumerate(zip(expected, actual)):
        assert torch.equal(a, b), f"gradient {i} differs (max |diff| {(a - b).abs().max()})"


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_offload_is_bitwise_equal(stash, kind):
    expected = run(kind, steps=2)
    actual = run(kind, steps=2, ctx=lambda: stash.offload(min_bytes=0))
    assert_bitwise(expected, actual)
    assert stash.stats()["tensors_offloaded"] > 0


@pytest.mark.parametrize("mode", ["offload", "checkpoint", "checkpoint+offload"])
def test_wrapped_gpt_blocks_are_bitwise_equal(stash, mode):
    from gpt import Block
    expected = run("gpt", steps=2)
    actual = run("gpt", steps=2,
                 prepare=lambda m: actstash.wrap(m, stash, blocks=Block, mode=mode, min_bytes=0))
    assert_bitwise(expected, actual)


def test_checkpoint_matches_torch_checkpoint_and_offloads_the_boundary(stash):
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def ours(m):
        for i, b in enumerate(m.blocks):
            m.blocks[i].forward = (lambda f: lambda x: actstash.checkpoint(
                f, x, stash=stash, min_bytes=0))(b.forward)

    def theirs(m):
        for i, b in enumerate(m.blocks):
            m.blocks[i].forward = (lambda f: lambda x: torch_checkpoint(
                f, x, use_reentrant=False))(b.forward)

    before = stash.stats()["tensors_offloaded"]
    assert_bitwise(run("gpt", prepare=theirs), run("gpt", prepare=ours))
    assert stash.stats()["tensors_offloaded"] > before, "block inputs went to the daemon"


def test_two_forwards_then_two_backwards(stash):
    def twice(ctx):
        torch.manual_seed(0)
        model, x = gpt(), torch.randint(0, 256, (4, 33))
        with ctx():
            a = loss_fn(model, x)
            b = loss_fn(model, x.flip(0))
        b.backward()
        a.backward()
        return grads(model)

    assert_bitwise(twice(_null), twice(lambda: stash.offload(min_bytes=0)))


def test_autograd_grad_and_retain_graph(stash):
    def grad_twice(ctx):
        torch.manual_seed(0)
        model, x = mlp(), torch.randn(32, 128)
        with ctx():
            loss = model(x).logsumexp(1).mean()
        first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        second = torch.autograd.grad(loss, list(model.parameters()))
        return list(first) + list(second)

    live_before = stash.stats()["live_bytes"]
    expected = grad_twice(_null)
    actual = grad_twice(lambda: stash.offload(min_bytes=0))
    assert_bitwise(expected, actual)
    assert_bitwise(actual[:len(actual) // 2], actual[len(actual) // 2:])
    gc.collect()
    assert stash.stats()["live_bytes"] == live_before, "released once the graph was freed"


def test_nested_offload_and_checkpoint(stash):
    def nested(m):
        inner = m.blocks[1].forward
        m.blocks[1].forward = lambda x: actstash.checkpoint(inner, x, stash=stash, min_bytes=0)

    expected = run("gpt")
    actual = run("gpt", prepare=nested,
                 ctx=lambda: _Both(stash.offload(min_bytes=0), stash.offload(min_bytes=1 << 30)))
    assert_bitwise(expected, actual)


class _Both:
    def __init__(self, a, b):
        self.a, self.b = a, b

    def __enter__(self):
        self.a.__enter__()
        self.b.__enter__()

    def __exit__(self, *exc):
        self.b.__exit__(*exc)
        self.a.__exit__(*exc)


def test_dropped_graph_releases_everything(stash):
    stash.synchronize()
    live_before = stash.stats()["live_bytes"]
    torch.manual_seed(0)
    model = gpt()
    with stash.offload(min_bytes=0):
        loss = loss_fn(model, torch.randint(0, 256, (4, 33)))
    assert stash.stats()["live_bytes"] > live_before
    del loss
    gc.collect()
    stash.synchronize()
    assert stash.stats()["live_bytes"] == live_before
    daemon_view = stash.client.stats()["self"]
    assert daemon_view["client"]["objects"] == 0 or live_before > 0


def test_parameters_and_small_tensors_stay(stash):
    torch.manual_seed(0)
    model = mlp()
    before = stash.stats()
    with stash.offload(min_bytes=1 << 40):
        model(torch.randn(32, 128)).sum().backward()
    after = stash.stats()
    assert after["tensors_offloaded"] == before["tensors_offloaded"]
    assert after["tensors_kept"] > before["tensors_kept"]


def test_in_place_change_after_saving_fails_backward_as_in_plain_autograd(stash):
    w = torch.randn(64, 64, requires_grad=True)
    e = torch.exp(w)  # plain autograd: saves its result, and notices the change
    e.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        e.sum().backward()
    with stash.offload(min_bytes=0):
        e = torch.exp(w)
        loss = e.sum()
    e.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_in_place_change_of_a_saved_input_fails_backward(stash):
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)
    loss = (x @ w).sum()  # plain autograd saves x for w's gradient
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    x = torch.randn(64, 64)
    with stash.offload(min_bytes=0):
        loss = (x @ w).sum()
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_bf16_downcast_stores_half_the_bytes_and_restores_the_rounded_values(daemon):
    stash = actstash.connect(daemon.socket, downcast="bf16")
    captured = []

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 1

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            captured.append(x.clone())
            return g

    try:
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                                3.4e38, -3.4e38, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])
        base = torch.cat([torch.randn(50_000), special]).requires_grad_()
        y = base * 1  # not a leaf: offloaded
        with stash.offload(min_bytes=0):
            loss = Save.apply(y).sum()
        loss.backward()
        assert stash.stats()["bytes_offloaded"] == y.numel() * 2
        got, want = captured[0], y.detach().bfloat16().float()
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
        assert got.dtype == torch.float32 and got.shape == y.shape
    finally:
        stash.close()


def test_downcast_value_is_checked(daemon):
    with pytest.raises(ValueError, match="downcast"):
        actstash.connect(daemon.socket, downcast="fp8")
