"""Stash.keep() and wrap() hold kept tensors weakly: once a kept model is freed,
its memory is no longer special, and new activations that the allocator places
at the freed addresses are offloaded like any other (they were silently kept
when raw addresses were recorded forever). While a kept tensor lives, it and
its views stay in-process; keep_registered counts the live registrations."""
import gc

import pytest
import torch
from torch import nn

import actstash

torch.set_num_threads(1)

_COUNTERS = ("tensors_offloaded", "bytes_offloaded", "tensors_fetched", "bytes_fetched",
             "tensors_kept", "kept_keep_listed", "kept_parameter", "keep_registered")

# 300 KiB: above glibc's initial mmap threshold and below its dynamic maximum, a size
# the heap hands back to the next request of the same size once the threshold rose.
N = 300 * 1024 // 4


@pytest.fixture
def stash(daemon):
    s = actstash.connect(daemon.socket, seed=7)
    assert s.client.attached
    yield s
    s.close()


def counters(stash):
    stats = stash.stats()
    return {k: stats[k] for k in _COUNTERS}


def delta(before, after):
    return {k: after[k] - before[k] for k in _COUNTERS}


def storage_address(t):
    return t.data_ptr() - t.storage_offset() * t.element_size()


class Save(torch.autograd.Function):
    """Saves exactly one tensor, `t` (which needs no gradient), for w's gradient."""

    @staticmethod
    def forward(ctx, t, w):
        ctx.save_for_backward(t)
        return (t * w).sum()

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        return None, (g * t).sum()


def _raise_mmap_threshold():
    # glibc raises its mmap threshold when an mmapped chunk is freed: afterwards
    # 300 KiB blocks come from the heap, where freed blocks are reused.
    big = torch.empty(1 << 20)
    del big


def test_freed_kept_model_addresses_are_offloaded_again(stash):
    _raise_mmap_threshold()
    reused = 0
    trials = 0
    for attempt in range(8):
        model = nn.Module()
        for i in range(3):
            model.register_parameter(f"p{i}", nn.Parameter(torch.randn(N)))
        model.register_buffer("b", torch.randn(N))
        stash.keep(model)
        assert stash.stats()["keep_registered"] == 4
        freed = {storage_address(t) for t in list(model.parameters()) + list(model.buffers())}
        del model
        gc.collect()
        assert stash.stats()["keep_registered"] == 0, "freed: no longer registered"

        for trial in range(20):
            t = torch.empty(N)
            reused += storage_address(t) in freed
            t.fill_(trial + 0.25)
            w = torch.ones((), requires_grad=True)
            before = counters(stash)
            with stash.offload(min_bytes=0):
                loss = Save.apply(t, w)
            stash.synchronize()
            middle = counters(stash)
            loss.backward()
            after = counters(stash)
            d = delta(before, middle)
            assert d["tensors_offloaded"] == 1, (attempt, trial, d)
            assert d["bytes_offloaded"] == N * 4, (attempt, trial, d)
            assert d["kept_keep_listed"] == 0, (attempt, trial, d)
            d = delta(middle, after)
            assert d["tensors_fetched"] == 1 and d["bytes_fetched"] == N * 4, (attempt, trial, d)
            expected = torch.ones((), requires_grad=True)
            Save.apply(t, expected).backward()  # plain autograd, same values
            assert torch.equal(w.grad, expected.grad)
            trials += 1
            del t, loss, w
        if reused:
            break
    assert reused > 0, ("no new tensor landed on a freed parameter's address in "
                        f"{trials} trials: the test proves nothing")


class Layer(nn.Module):
    """A square layer: its weight and its input have the same size (256 KiB), so
    activations of one model can land where the previous model's weights were."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


class Net(nn.Module):
    def __init__(self, dim=256, layers=3):
        super().__init__()
        self.layers = nn.ModuleList([Layer(dim) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _grads_plain(seed, dim=256):
    torch.manual_seed(seed)
    model = Net(dim)
    x = torch.randn(dim, dim)
    model(x).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_recreated_wrapped_model_offloads_every_block_input(stash):
    _raise_mmap_threshold()
    dim, layers = 256, 3
    per_input = dim * dim * 4
    freed_weights = set()  # addresses of weights of models already freed
    current_weights = set()
    landed_on_freed = 0
    # A training process that re-creates its model (3 iterations); repeated a few
    # times only until some block input lands where a freed model's weight was.
    for round_ in range(5):
        model = None
        for iteration in range(3):
            torch.manual_seed(iteration)
            model = Net(dim, layers)  # the previous model is freed here, after this is built
            gc.collect()
            freed_weights |= current_weights
            current_weights = {storage_address(p) for p in model.parameters()}
            freed_weights -= current_weights
            actstash.wrap(model, stash, blocks=Layer, mode="checkpoint+offload", min_bytes=0)
            assert stash.stats()["keep_registered"] == layers, "only the live model's weights"
            inputs = []
            hooks = [layer.register_forward_pre_hook(
                lambda m, args: inputs.append(storage_address(args[0])))
                for layer in model.layers]
            x = torch.randn(dim, dim)
            before = counters(stash)
            loss = model(x)
            middle = counters(stash)
            stash.synchronize()
            loss.backward()
            after = counters(stash)
            for h in hooks:
                h.remove()
            landed_on_freed += sum(a in freed_weights for a in inputs)

            where = (round_, iteration)
            d = delta(before, middle)
            assert d["tensors_offloaded"] == layers, (where, d)
            assert d["bytes_offloaded"] == layers * per_input, (where, d)
            assert d["kept_keep_listed"] == 0, (where, d)
            d = delta(middle, after)
            assert d["tensors_fetched"] == layers, (where, d)
            assert d["bytes_fetched"] == layers * per_input, (where, d)
            grads = [p.grad for p in model.parameters()]
            expected = _grads_plain(iteration, dim)
            assert len(grads) == len(expected)
            for a, b in zip(expected, grads):
                assert torch.equal(a, b), where
            del loss, x
        if landed_on_freed:
            break
    assert landed_on_freed > 0, ("no block input landed on a freed model's weight: the test "
                                 "proves nothing")


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(128, 128)
        self.register_buffer("proj", torch.randn(128, 256))

    def forward(self, x):
        h = self.fc(x)        # saves x (offloaded) and fc.weight (a parameter)
        return h @ self.proj  # saves proj (the kept buffer) for h's gradient


def test_kept_tensors_stay_while_alive_and_registrations_drop_when_freed(stash):
    def run(offload):
        torch.manual_seed(0)
        module = WithBuffer()
        table = torch.randn(64, 256)  # a plain tensor passed to keep()
        x0 = torch.randn(64, 128, requires_grad=True)
        if offload:
            stash.keep(module, table)
            assert stash.stats()["keep_registered"] == 4  # weight, bias, proj, table
        before = counters(stash)
        with (stash.offload(min_bytes=0) if offload else _null()):
            x = x0 * 1
            y = module(x)
            z = y * table            # saves table (y needs a gradient)
            u = y * table.t().t()    # a view of table: aliases it, kept too
            loss = (z + u).sum()
        middle = counters(stash)
        stash.synchronize()
        loss.backward()
        grads = [p.grad.clone() for p in module.parameters()] + [x0.grad.clone()]
        return grads, delta(before, middle), module, table

    expected, _, _, _ = run(False)
    actual, d, module, table = run(True)
    for a, b in zip(expected, actual):
        assert torch.equal(a, b)
    assert d["kept_keep_listed"] == 3, d  # proj, table, table's view
    assert d["tensors_offloaded"] >= 1, d  # x (saved by fc) went to the daemon
    assert d["kept_parameter"] >= 1, d     # fc.weight: a parameter, kept as such

    # Still kept while alive: a second forward keeps them again.
    before = counters(stash)
    with stash.offload(min_bytes=0):
        loss = (torch.randn(64, 256, requires_grad=True) * 1 * table).sum()
    assert delta(before, counters(stash))["kept_keep_listed"] == 1
    loss.backward()

    del module
    gc.collect()
    assert stash.stats()["keep_registered"] == 1, "only table is left"
    del table
    gc.collect()
    assert stash.stats()["keep_registered"] == 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_keep_of_a_temporary_alias_keeps_the_storage(daemon):
    """keep(w.t()) or keep(w.detach()) keeps w's storage while w lives, and does not
    cancel an earlier keep(w)."""
    stash = actstash.connect(daemon.socket)
    w = torch.randn(256, 256)  # a frozen weight: matmul saves it

    def probe():
        before = stash.stats()
        x = torch.randn(256, 256, requires_grad=True) * 1
        with stash.offload(min_bytes=0):
            loss = (x @ w).sum()
        after = stash.stats()
        loss.backward()
        return (after["kept_keep_listed"] - before["kept_keep_listed"],
                after["tensors_offloaded"] - before["tensors_offloaded"])

    assert probe() == (0, 1), "nothing kept yet: w (what mm saves here) is offloaded"
    stash.keep(w)
    assert probe() == (1, 0)
    stash.keep(w.t())
    assert probe() == (1, 0), "an alias does not cancel the earlier keep"
    stash.keep(w.detach())
    assert probe() == (1, 0)
    assert stash.stats()["keep_registered"] == 1
    w = None  # the kept storage is freed
    gc.collect()
    assert stash.stats()["keep_registered"] == 0
    stash.close()


def test_a_leaf_activation_is_offloaded_a_parameter_kept(stash):
    """A leaf that requires grad but is no parameter (a pipeline stage's received
    activation) goes to the daemon; a parameter and its views stay."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(128, 128))
    received = torch.randn(64, 128, requires_grad=True)  # as a pipeline stage gets it

    def grads():
        weight.grad = received.grad = None
        return (received @ weight.t()).sin().sum()

    grads().backward()
    expected = (weight.grad.clone(), received.grad.clone())
    before = counters(stash)
    with stash.offload(min_bytes=0):
        loss = grads()
    middle = counters(stash)
    stash.synchronize()
    loss.backward()
    d = delta(before, middle)
    assert torch.equal(weight.grad, expected[0]) and torch.equal(received.grad, expected[1])
    assert d["kept_parameter"] == 1, d  # weight.t(): a view of the parameter
    # received (saved by the matmul) and the matmul's output (saved by sin) went.
    assert d["tensors_offloaded"] == 2, d
    assert d["bytes_offloaded"] == 2 * 64 * 128 * 4, d


def test_default_blocks_are_the_outermost_repeated_layers(stash):
    """wrap() without blocks= takes the layers, not a longer list of experts nested
    inside each layer (a mixture-of-experts model)."""
    import actstash

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(6)])

        def forward(self, x):
            return sum(e(x) for e in self.experts)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Model()
    actstash.wrap(model, stash, mode="offload")
    wrapped = [m for m in model.modules() if getattr(m, "_actstash_forward", None)]
    assert wrapped == list(model.layers)
    actstash.unwrap(model)
