"""Every wrap mode on every device this machine has, the same code on each: a GPT's
blocks offloaded, checkpointed, or checkpointed with their inputs offloaded, in fp32
and bf16, against plain autograd on the same seed (dropout on: the RNG replay is
checked too). On CUDA the compute stream is slowed before every block (a spin kernel
ahead of the producers), the race that corrupts other offloaders' gradients. Bitwise
gradients, and the bytes went to the daemon and came back (stats). Also on CUDA:
two processes offloading through one daemon at once, and torch.compile of blocks
wrapped for offload. On a machine without a GPU only the CPU cases run; the GPU kit
runs this file on its GPU machine."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import actstash
from actstash._native import lib as _lib
from actstash_testing.training import assert_bitwise
from conftest import PACKAGE_ENV, TESTING_PYTHON, EXAMPLES
from gpt import GPT, loss_fn

CUDA = torch.cuda.is_available() and _lib.cuda_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
SPIN_CYCLES = 5_000_000  # a few ms per block on an H100's clock


def make(device, dtype):
    torch.manual_seed(0)
    return GPT(vocab=256, dim=128, heads=4, layers=4, context=128).to(device=device, dtype=dtype)


def slowed(model):
    """A spin kernel on the current stream before every block (CUDA only)."""
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(SPIN_CYCLES))
    return model


def grads(model, idx, steps=2):
    out = None
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(10 + step)
        loss_fn(model, idx).backward()
        out = [p.grad.clone() for p in model.parameters()]
    if idx.is_cuda:
        torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["offload", "checkpoint", "checkpoint+offload"])
def test_mode_is_bitwise_and_moves_the_bytes(daemon, device, dtype, mode):
    idx = torch.randint(0, 256, (4, 129), generator=torch.Generator().manual_seed(1)).to(device)
    plain = make(device, dtype)
    wrapped = copy.deepcopy(plain)
    if device == "cuda":
        slowed(plain)
        slowed(wrapped)
    expected = grads(plain, idx)
    stash = actstash.connect(daemon.socket)
    try:
        before = stash.stats()
        actstash.wrap(wrapped, stash, mode=mode, min_bytes=0)
        assert_bitwise(expected, grads(wrapped, idx))
        after = stash.stats()
        moved = after["bytes_offloaded"] - before["bytes_offloaded"]
        fetched = after["bytes_fetched"] - before["bytes_fetched"]
        if mode == "checkpoint":
            assert moved == 0
        else:
            assert moved > 0 and fetched > 0, (moved, fetched)
            assert after["store_failures"] == before["store_failures"]
        if device == "cuda" and mode != "checkpoint":
            assert after["cuda_kept"] == before["cuda_kept"]  # CUDA tensors left the GPU
    finally:
        stash.close()


RUNNER = r"""
import json, sys, torch
sys.path[:0] = [sys.argv[2], sys.argv[3]]
import actstash
from actstash_testing.training import bitwise_equal
from gpt import GPT, loss_fn

def grads(model, idx):
    for step in range(3):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(20 + step)
        loss_fn(model, idx).backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters()]

rank = int(sys.argv[4])
torch.manual_seed(rank)
plain = GPT(vocab=256, dim=256, heads=4, layers=4, context=256).cuda()
wrapped = GPT(vocab=256, dim=256, heads=4, layers=4, context=256).cuda()
wrapped.load_state_dict(plain.state_dict())
idx = torch.randint(0, 256, (8, 257), device="cuda")
expected = grads(plain, idx)
stash = actstash.connect(sys.argv[1], name="rank%d" % rank)
actstash.wrap(wrapped, stash, mode="offload", min_bytes=0)
same = bitwise_equal(expected, grads(wrapped, idx))
stats = stash.stats()
stash.close()
print(json.dumps({"bitwise": same, "offloaded": stats["bytes_offloaded"],
                  "fetched": stats["bytes_fetched"]}))
"""


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch and actstash)")
def test_two_processes_share_one_daemon_on_cuda(daemon):
    env = dict(os.environ, **PACKAGE_ENV)
    procs = [subprocess.Popen([sys.executable, "-c", RUNNER, daemon.socket, TESTING_PYTHON,
                               EXAMPLES, str(rank)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["bitwise"], result
        assert result["offloaded"] > 0 and result["fetched"] > 0, result


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch and actstash)")
def test_compiled_offload_blocks_on_cuda(daemon):
    if not hasattr(torch, "compiler"):
        pytest.skip("torch.compile needs torch >= 2.1")
    import torch._dynamo as dynamo
    idx = torch.randint(0, 256, (4, 129), generator=torch.Generator().manual_seed(1)).cuda()

    def compiled(model):
        dynamo.reset()
        for block in model.blocks:
            block.compile()
        grads(model, idx, steps=1)  # compiles
        return grads(model, idx)

    plain = make("cuda", torch.float32)
    wrapped = copy.deepcopy(plain)
    expected = compiled(plain)
    stash = actstash.connect(daemon.socket)
    try:
        actstash.wrap(wrapped, stash, mode="offload", min_bytes=0)
        assert_bitwise(expected, compiled(wrapped))
        assert stash.stats()["bytes_offloaded"] > 0
    finally:
        stash.close()
