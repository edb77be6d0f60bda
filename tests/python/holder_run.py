"""Child of test_spill.py: a trainer that stores its activations in the daemon's pool,
then sleeps holding them (a paused job, a rank at a barrier) until a line arrives on
stdin, then runs backward. Prints two JSON lines: when it holds, and at the end
(its gradients against plain autograd's on the same seed, and what it gave back when
the daemon asked for memory while it slept).

    holder_run.py SOCKET LAYERS
"""
import json
import sys

import torch

import actstash

torch.set_num_threads(1)


def mlp(layers):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                     torch.nn.Tanh()) for _ in range(layers)])


def grads_of(model, stash=None, hold=None):
    x = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(1))  # 8 MiB
    model.zero_grad()
    if stash is None:
        loss = model(x).square().mean()
    else:
        with stash.offload():
            loss = model(x).square().mean()
        hold()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def main():
    socket, layers = sys.argv[1], int(sys.argv[2])
    plain = grads_of(mlp(layers))
    stash = actstash.connect(socket)

    def hold():
        stash.synchronize()
        print(json.dumps({"holding": stash.stats()["leased_bytes"]}), flush=True)
        sys.stdin.readline()

    grads = grads_of(mlp(layers), stash, hold)
    s = stash.stats()
    print(json.dumps({
        "bitwise": all(torch.equal(a, b) for a, b in zip(plain, grads)),
        "spilled": s["bytes_spilled"], "restored": s["bytes_restored"],
        "reclaims_asked": s["reclaims_asked"], "reclaims_answered": s["reclaims_answered"],
        "reclaim_bytes_given": s["reclaim_bytes_given"]}), flush=True)
    stash.close()


if __name__ == "__main__":
    main()
