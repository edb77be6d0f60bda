"""Edge cases of the hooks over the native engine, found in review: tensors on devices
no engine copies, in-place changes seen only through a view's base, and a checkpointed
function that changes its (stored) input in place."""
import os

import pytest
import torch
import torch.nn.functional as F

import actstash


def test_meta_tensors_are_kept_not_copied(stash):
    before = stash.stats()
    x = torch.randn(1 << 16, device="meta", requires_grad=True)
    with stash.offload(min_bytes=0):
        y = (x + 1).sin()  # sin saves its meta input
    after = stash.stats()
    assert y.device.type == "meta"
    assert after["kept_device"] > before["kept_device"]
    assert after["tensors_offloaded"] == before["tensors_offloaded"]


def _conj_and_neg_grads(stash):
    torch.manual_seed(0)
    a = torch.randn(64, 64, dtype=torch.cfloat, requires_grad=True)
    b = torch.randn(64, 64, dtype=torch.cfloat, requires_grad=True)
    c = torch.randn(64, 64, requires_grad=True)

    def loss():
        # mm saves b.conj(), a view with the conjugate bit: its bytes are b's. The
        # negative bit (torch._neg_view) is the same kind of lazy flag.
        left = ((a * 2) @ (b * 3).conj()).abs().sum()
        right = ((c * 2) * torch._neg_view(c * 3)).sin().sum()
        return left + right

    if stash is None:
        loss().backward()
    else:
        with stash.offload(min_bytes=0):
            out = loss()
        stash.synchronize()
        out.backward()
    return [a.grad, b.grad, c.grad]


def test_lazily_conjugated_or_negated_tensors_are_kept(stash):
    # Stored as raw bytes, such a tensor would come back without its flag: silently
    # wrong gradients. Both front-ends keep it (a layout the engine does not copy).
    expected = _conj_and_neg_grads(None)
    before = stash.stats()
    actual = _conj_and_neg_grads(stash)
    after = stash.stats()
    assert all(torch.equal(e, g) for e, g in zip(expected, actual))
    assert after["kept_layout"] >= before["kept_layout"] + 2
    assert after["tensors_offloaded"] > before["tensors_offloaded"]  # the others went
    assert after["tensors_fetched"] - before["tensors_fetched"] == (
        after["tensors_offloaded"] - before["tensors_offloaded"])


def test_in_place_change_through_the_base_of_a_saved_view_fails_backward(stash):
    a = torch.randn(64, 64)
    w = torch.randn(64, 64, requires_grad=True)
    # Plain autograd: mm saves the view; changing its base is caught.
    loss = (a.view(64, 64) @ w).sum()
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    a = torch.randn(64, 64)
    before = stash.stats()["tensors_offloaded"]
    with stash.offload(min_bytes=0):
        loss = (a.view(64, 64) @ w).sum()  # the view object dies here; a lives on
    assert stash.stats()["tensors_offloaded"] > before
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_checkpointed_function_may_change_its_input_in_place(stash):
    torch.manual_seed(0)
    w = torch.randn(256, 256, requires_grad=True)

    def block(x):
        x.mul_(0.5)  # in place on the (stored) input, which needs no grad
        return F.gelu(x @ w)

    def run(checkpointed):
        w.grad = None
        x = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
        y = actstash.checkpoint(block, x, stash=stash, use_reentrant=False) if checkpointed \
            else block(x)
        y.sum().backward()
        return w.grad.clone()

    expected = run(False)
    before = stash.stats()
    actual = run(True)
    after = stash.stats()
    assert torch.equal(expected, actual)
    assert after["tensors_offloaded"] - before["tensors_offloaded"] == 1  # the input
    assert after["tensors_fetched"] - before["tensors_fetched"] == 1


def test_the_fetch_needed_now_is_enqueued_before_prefetches(stash, monkeypatch):
    """The fetch stream is first in, first out: an unpack that must copy its tensor
    back enqueues that copy before the prefetches the engine offered with it, or
    backward would wait for copies it needs only later. (The engine offers prefetches
    for CUDA tensors only: the offer is staged here, the calls are the real order.)"""
    from actstash._hooks import _stash
    from actstash._native import lib as _lib
    with stash.offload(min_bytes=0):
        saved = stash._pack(torch.randn(64, 1024))
        later = stash._pack(torch.randn(64, 1024))
    calls = []

    def unpack(engine, id_, version, out, out_len):
        out[0], out[4] = _stash._DESTINATION, 1  # copy it back; one prefetch offered
        return 0

    monkeypatch.setattr(_lib, "engine_unpack", unpack)
    monkeypatch.setattr(_stash, "_take_offers", lambda out: [(later.id, later)])
    monkeypatch.setattr(_lib, "engine_fetch_into",
                        lambda engine, id_, *a: calls.append(("fetch", id_)) or 0)
    monkeypatch.setattr(_lib, "engine_prefetch",
                        lambda engine, id_, *a: calls.append(("prefetch", id_)) or 0)
    stash._unpack(saved, check_version=False)
    assert calls == [("fetch", saved.id), ("prefetch", later.id)]


def test_exit_with_copies_in_flight_is_clean(daemon):
    """A trainer that exits with stores still in flight (slow copies, no backward, no
    synchronize): the engine is freed by actstash's exit handler, while the
    interpreter and the copy runtime still work (with CUDA, the statically linked
    runtime is torn down by the C library's exit handlers, after Python's), and the
    process exits 0 without a crash or a warning."""
    import subprocess
    import sys
    from conftest import PACKAGE_ENV
    code = f"""
import atexit, torch
report = {{}}
# Registered before actstash's own handler: runs after it.
atexit.register(lambda: print("freed at exit:", stash._engine.ptr is None,
                              "in flight before:", report["in_flight"], flush=True))
import actstash
stash = actstash.connect({daemon.socket!r}, copy_delay_us=200000)
x = torch.randn(256, 1024, requires_grad=True)
with stash.offload(min_bytes=0):
    y = (x.exp() * 2).sin()
report["in_flight"] = stash.stats()["in_flight"]
"""
    env = dict(os.environ, **PACKAGE_ENV)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "freed at exit: True" in done.stdout, (done.stdout, done.stderr)
    in_flight = int(done.stdout.split("in flight before:")[1].split()[0])
    assert in_flight > 0, done.stdout  # the exit really happened with copies in flight
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr
