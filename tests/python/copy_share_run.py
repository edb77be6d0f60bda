"""Child process of test_copy_share.py: one trainer of several on one daemon. Trains a
small GPT under wrap(policy="auto") until its plan counts on a share of the node's copy
bandwidth divided among `expected` copying sessions (or a deadline passes), checking each
step's gradients against plain autograd; prints what its plan used as one JSON line, then
keeps its session open until stdin says to go (a trainer that closed early would leave
the others counting fewer sessions than there were).

    copy_share_run.py SOCKET EXPECTED_SESSIONS
"""
import copy
import json
import sys
import time

import torch

import actstash
from actstash_testing.training import bitwise_equal, cloned_grads

torch.set_num_threads(1)
DEADLINE_S = 300


def main():
    from gpt import GPT, loss_fn
    socket, expected = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=64, heads=2, layers=3, context=32)
    plain = copy.deepcopy(model)
    idx = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    stash = actstash.connect(socket)
    actstash.wrap(model, stash, policy="auto", budget="1GiB", min_bytes=0)

    def step(m, seed):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss_fn(m, idx).backward()
        return cloned_grads(m)

    start, steps, bitwise, rates = time.monotonic(), 0, True, None
    while time.monotonic() - start < DEADLINE_S:
        bitwise &= bitwise_equal(step(model, steps), step(plain, steps))
        steps += 1
        report = stash.plan()
        rates = report.copy_rates if report is not None else None
        if rates and rates["copying_sessions"] >= expected and steps >= 3:
            break
        time.sleep(0.05)
    stash.synchronize()
    print(json.dumps({"rates": rates, "steps": steps, "bitwise": bitwise,
                      "offloaded": stash.stats()["bytes_offloaded"], "table": str(stash.plan())}),
          flush=True)
    sys.stdin.readline()
    actstash.unwrap(model)
    stash.close()


if __name__ == "__main__":
    main()
