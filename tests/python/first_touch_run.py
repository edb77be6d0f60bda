"""Child of test_first_touch.py: minor page faults per steady-state training step
of a small nn.TransformerEncoder, plain autograd, then wrapped (argv[2]: the mode)
with the daemon at argv[1], then plain again; prints them and the stash's
counters over the wrapped steps as JSON. Run with glibc told to keep freed
memory (the parent sets MALLOC_*), so that the plain steps fault (almost)
nothing and what the stash adds shows."""
import copy
import json
import resource
import sys

import torch
import actstash
torch.set_num_threads(1)
socket, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
D, L, B, T = 128, 4, 4, 64


def build():
    return torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(
        D, 4, 4 * D, dropout=0.0, batch_first=True) for _ in range(L)])


base = build()
x = torch.randn(B, T, D)


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run(model, steps=14):
    out = []
    for k in range(steps):
        model.zero_grad(set_to_none=True)
        f = faults()
        model(x).square().mean().backward()
        out.append(faults() - f)
    return out[6:]  # the steady steps


stash = actstash.connect(socket)
plain = run(copy.deepcopy(base))
wrapped = actstash.wrap(copy.deepcopy(base), stash, blocks=torch.nn.TransformerEncoderLayer,
                        mode=mode, min_bytes=16 << 10)
s0 = stash.stats()
with_stash = run(wrapped)
s1 = stash.stats()
plain2 = run(copy.deepcopy(base))
print(json.dumps({"plain": plain, "stash": with_stash, "plain2": plain2,
                  "offloaded": s1["bytes_offloaded"] - s0["bytes_offloaded"],
                  "fetched": s1["tensors_fetched"] - s0["tensors_fetched"]}))
