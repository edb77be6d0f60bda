"""The parity table (tests/parity_table.inc, which tests/torch/torch_offload_test.cc
runs against the C++ front-end): model × mode × injected copy delay × how backward
reads CPU tensors.
Every row: parameter gradients bitwise equal to plain autograd on the same seed, and
the bytes really went to the daemon and came back (the engine's counters)."""
import gc
import os
import re

import pytest
import torch

import actstash
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
