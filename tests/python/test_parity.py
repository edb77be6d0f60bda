"""The parity table (tests/parity_table.inc, which tests/torch/torch_offload_test.cc
runs against the C++ front-end): model × mode × injected copy delay × how backward
reads CPU tensors.
Every row: parameter gradients bitwise equal to plain autograd on the same seed, and
the bytes really went to the daemon and came back (the engine's counters). Its keep
rows: the reason each front-end counts for a tensor it keeps, the same in both."""
import gc
import os
import re

import pytest
import torch

import actstash
from actstash._native import lib as _lib
from gpt import GPT, Block, loss_fn
from conftest import ROOT
from test_offload import Weird

torch.set_num_threads(1)

MODELS = {
    "gpt": (lambda: GPT(vocab=256, dim=64, heads=4, layers=3, context=32),
            lambda m, g: loss_fn(m, torch.randint(0, 256, (4, 33), generator=g)), Block),
    "weird": (Weird, lambda m, g: m(torch.randn(32, 64, generator=g)), torch.nn.Linear),
}


def _shared_rows():
    """The rows of tests/parity_table.inc, which the C++ suite includes."""
    with open(os.path.join(ROOT, "tests", "parity_table.inc")) as f:
        rows = re.findall(r'^PARITY_ROW\("([a-z+]+)", (\d+), (true|false)\)$', f.read(), re.M)
    assert rows, "no PARITY_ROW in tests/parity_table.inc"
    return [(mode, int(delay), views == "true") for mode, delay, views in rows]


TABLE = [(model, *row) for model in MODELS for row in _shared_rows()]


def _grads(model_name, step):
    make, run, _ = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    return model, (lambda: run(model, torch.Generator().manual_seed(step)))


@pytest.mark.parametrize("model_name,mode,delay_us,cpu_views", TABLE)
def test_parity(daemon, model_name, mode, delay_us, cpu_views):
    stash = actstash.connect(daemon.socket, copy_delay_us=delay_us, seed=1, cpu_views=cpu_views)
    plain, plain_loss = _grads(model_name, 1)
    torch.manual_seed(2)
    plain_loss().backward()
    expected = [p.grad.clone() for p in plain.parameters()]

    model, loss = _grads(model_name, 1)
    if mode != "offload":
        actstash.wrap(model, stash, blocks=MODELS[model_name][2], mode=mode, min_bytes=0)
    torch.manual_seed(2)
    if mode == "offload":
        with stash.offload(min_bytes=0):
            out = loss()
    else:
        out = loss()
    stash.synchronize()  # the stores are done: backward must fetch, not use the sources
    out.backward()
    actual = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))

    del out
    gc.collect()
    stash.synchronize()
    s = stash.stats()
    if mode == "checkpoint":
        assert s["tensors_offloaded"] == 0
    else:
        assert s["tensors_offloaded"] > 0 and s["bytes_offloaded"] > 0
        assert s["tensors_fetched"] == s["tensors_offloaded"], s
        assert s["unpacked_from_source"] == 0
        if cpu_views:  # read in place from 32 KiB up, smaller ones copied back
            assert s["views"] <= s["tensors_fetched"]
            assert s["views"] > 0 or model_name == "weird"  # weird's are all < 32 KiB
        else:
            assert s["views"] == 0
        if mode == "checkpoint+offload":  # block inputs: stored before the block runs
            assert s["inline_stores"] == s["tensors_offloaded"]
        elif delay_us:
            assert s["inline_stores"] == 0
    assert s["live_bytes"] == 0 and s["in_flight"] == 0
    stash.close()


def _keep_rows():
    """The KEEP_ROW lines of tests/parity_table.inc, which the C++ suite includes."""
    with open(os.path.join(ROOT, "tests", "parity_table.inc")) as f:
        rows = re.findall(r'^KEEP_ROW\("(\w+)", "(\w*)"\)$', f.read(), re.M)
    assert rows, "no KEEP_ROW in tests/parity_table.inc"
    return rows


def _keep_case_tensor(name):
    """The tensor a KEEP_ROW names, made outside the scope (only sin's save of it is
    counted inside)."""
    a = torch.randn(64, 64)
    return {
        "activation": lambda: a.requires_grad_() * 2,
        "small_activation": lambda: torch.randn(16).requires_grad_() * 2,
        "small_parameter": lambda: torch.nn.Parameter(torch.randn(16)),
        "parameter": lambda: torch.nn.Parameter(a),
        "transposed_parameter": lambda: torch.nn.Parameter(a).t(),
        "conjugate": lambda: (torch.randn(64, 64, dtype=torch.cfloat).requires_grad_() * 2).conj(),
        "meta": lambda: torch.empty(64, 64, device="meta").requires_grad_(),
        "broadcast": lambda: (torch.randn(1, 64).requires_grad_() * 2).expand(64, 64),
        "overlapping": lambda: (torch.randn(4096).requires_grad_() * 2).as_strided((4095, 2),
                                                                                   (1, 1)),
    }[name]()


@pytest.mark.parametrize("name,reason", _keep_rows())
def test_keep_parity(daemon, name, reason):
    stash = actstash.connect(daemon.socket)
    try:
        x = _keep_case_tensor(name)
        before = stash.stats()
        with stash.offload(min_bytes=4 << 10):
            y = x.sin()
        after = stash.stats()
        assert (after["tensors_kept"] + after["tensors_offloaded"]
                == before["tensors_kept"] + before["tensors_offloaded"] + 1)  # sin: its input
        if not reason:
            assert after["tensors_offloaded"] == before["tensors_offloaded"] + 1, name
        else:
            for r in _lib.DESCRIPTION["keep_reasons"]:
                key = "kept_" + r
                assert after[key] == before[key] + (r == reason), (name, key)
        del y
        gc.collect()
        stash.synchronize()
        assert stash.stats()["live_bytes"] == 0
    finally:
        stash.close()
