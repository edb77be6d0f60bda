"""connect(simulate_link_gbps=R), the test knob that gives a CPU run a GPU's link:
every saved CPU tensor crosses the copy engine both ways (no inline copy, no view),
each copy takes at least bytes / R, fetches are prefetched as CUDA tensors are, and
gradients stay bitwise those of plain autograd."""
import time

import pytest
import torch

import actstash

LAYERS = 6
WIDTH = 256  # a 64 x 256 fp32 activation: 64 KiB


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH),
                                                     torch.nn.Tanh())
                                 for _ in range(LAYERS)])


def _step(model, stash=None):
    x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    if stash is None:
        model(x).pow(2).sum().backward()
    else:
        with stash.offload(min_bytes=0):
            loss = model(x).pow(2).sum()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("gbps", [0.05, 0.2])
def test_every_saved_tensor_crosses_the_link_both_ways_at_its_rate(fresh_daemon, gbps):
    """With one store in flight at a time (max_in_flight_bytes=1), forward waits for
    each store but the last; backward then reads every tensor back over the link."""
    plain = _step(_model())
    with actstash.connect(fresh_daemon.socket, simulate_link_gbps=gbps,
                          max_in_flight_bytes=1) as stash:
        assert stash.simulated_link_bps == round(gbps * 1e9)
        model = _model()
        _step(model, stash)  # leases and pools warm
        before = stash.stats()
        start = time.perf_counter()
        grads = _step(model, stash)
        took = time.perf_counter() - start
        after = stash.stats()
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
    stored, moved = delta["tensors_offloaded"], delta["bytes_offloaded"]
    assert moved >= LAYERS * 64 * WIDTH * 4, delta  # at least each layer's input
    # Each came back through the copy engine (no view, no inline copy), but the last
    # one, whose store may still run when backward needs it (its source serves it).
    assert delta["views"] == 0, delta
    assert delta["tensors_fetched"] + delta["unpacked_from_source"] == stored, delta
    assert delta["unpacked_from_source"] <= 1, delta
    assert delta["prefetch_issued"] > 0, delta  # prefetched, as CUDA tensors are
    # Forward waited for all stores but the last, backward for every fetch, each lane
    # at the rate: 64 KiB is the largest tensor.
    link = (moved - 64 * WIDTH * 4 + delta["bytes_fetched"]) / (gbps * 1e9)
    assert took >= 0.95 * link, (took, link, delta)
    for mine, theirs in zip(grads, plain):
        assert torch.equal(mine, theirs)


def test_a_checkpoint_boundary_crosses_the_link_too(fresh_daemon):
    """A checkpoint's input is stored synchronously (the caller may change it after):
    through the link, waited for, not copied on the calling thread."""
    gbps = 0.05
    x = torch.randn(512, 512, requires_grad=True)  # 1 MiB: 21 ms each way at 50 MB/s
    with actstash.connect(fresh_daemon.socket, simulate_link_gbps=gbps) as stash:
        start = time.perf_counter()
        y = actstash.checkpoint(torch.tanh, x * 1, stash=stash)
        took = time.perf_counter() - start
        y.sum().backward()
        stats = stash.stats()
    assert took >= 0.95 * x.numel() * 4 / (gbps * 1e9), took
    assert stats["tensors_offloaded"] == 1 and stats["tensors_fetched"] == 1, stats
    plain = x.detach().clone().requires_grad_()
    torch.tanh(plain * 1).sum().backward()
    assert torch.equal(x.grad, plain.grad)


@pytest.mark.parametrize("bad", [0, -1.0, "1", True, float("inf")])
def test_a_rate_that_is_not_a_positive_number_is_refused(fresh_daemon, bad):
    with pytest.raises(ValueError, match="simulate_link_gbps"):
        actstash.connect(fresh_daemon.socket, simulate_link_gbps=bad)


def test_the_plan_counts_what_waits_for_the_link(fresh_daemon):
    """The rule the automatic plan models copies with: on a simulated link no store is
    copied on the packing thread, but a checkpoint boundary's is still waited for
    (compute-thread time); wrap(policy="auto") plans and trains bitwise on the link."""
    from actstash import _hooks
    with actstash.connect(fresh_daemon.socket) as stash:
        assert _hooks.copied_inline(stash, 4096, False, False)
        assert _hooks.copied_inline(stash, 1 << 20, False, True)
    plain = []
    model = _model()
    for _ in range(4):
        plain.append(_step(model))
    with actstash.connect(fresh_daemon.socket, simulate_link_gbps=0.2) as stash:
        assert not _hooks.copied_inline(stash, 4096, False, False)
        assert _hooks.copied_inline(stash, 1 << 20, False, True)  # waited for
        model = _model()
        actstash.wrap(model, stash, blocks=torch.nn.Sequential, policy="auto",
                      budget=1 << 40, min_bytes=0)
        for k in range(4):
            x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(1))
            model.zero_grad()
            model(x).pow(2).sum().backward()
            for mine, theirs in zip([p.grad for p in model.parameters()], plain[k]):
                assert torch.equal(mine, theirs), k
        assert stash.plan() is not None and not stash.plan().pending
