"""A trainer for the take-over tests and benchmark: a GPT whose blocks offload
through actstashd, each step checked bitwise against plain autograd on the same
seed (step i uses seed i mod --references, whose plain gradients are computed
once at the start, so that the trainer spends its time in offloaded steps), until
a stop file appears; then one JSON line: steps, steps not bitwise,
tensors offloaded and fetched, calls that paused for a take-over or restart,
attach connections made again after a restart, step times.

    python3 takeover_run.py SOCKET STOP_FILE READY_FILE [--dim 128] [--inline] [--quota BYTES]

--inline stores through the daemon's inline path (Put/Get, no attach connection);
--quota bounds the session, so that with a spill tier its data is spilled (zero-copy
blocks by the client, inline objects by the daemon).
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "testing", "python"))
from actstash_testing.paths import BUILD_PYTHON, EXAMPLES  # noqa: E402

if os.environ.get("ACTSTASH_TEST_INSTALLED") != "1":
    sys.path.insert(0, BUILD_PYTHON)
sys.path.insert(0, EXAMPLES)
import torch  # noqa: E402

import actstash  # noqa: E402
from gpt import GPT, loss_fn  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("stop_file")
    parser.add_argument("ready_file")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--inline", action="store_true")
    parser.add_argument("--quota", type=int, default=None)
    parser.add_argument("--references", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(os.getpid())
    plain = GPT(vocab=256, dim=args.dim, heads=4, layers=4, context=64)
    model = copy.deepcopy(plain)
    idx = torch.randint(0, 256, (8, 65))
    # lease_retain_ms=0: leases go back after every step and are leased again,
    # so that steps make Lease and Return calls while daemons are replaced.
    stash = actstash.connect(args.socket, lease_retain_ms=0, reattach_timeout_ms=30000,
                             attach="off" if args.inline else "auto", quota=args.quota)
    assert args.inline or stash.client.attached, stash.client.attach_error
    actstash.wrap(model, stash, mode="offload", min_bytes=0)

    def grads(m, step):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss_fn(m, idx).backward()
        return [p.grad.clone() for p in m.parameters()]

    references = [grads(plain, seed) for seed in range(args.references)]
    steps = not_bitwise = 0
    times = []
    open(args.ready_file, "w").close()
    while not os.path.exists(args.stop_file):
        expected = references[steps % args.references]
        start = time.perf_counter()
        actual = grads(model, steps % args.references)
        times.append(time.perf_counter() - start)
        not_bitwise += not all(torch.equal(a, b) for a, b in zip(expected, actual))
        steps += 1
    stats = stash.stats()
    stash.close()
    print(json.dumps({"steps": steps, "not_bitwise": not_bitwise,
                      "offloaded": stats["tensors_offloaded"], "fetched": stats["tensors_fetched"],
                      "failures": stats["store_failures"], "pauses": stats["daemon_pauses"],
                      "reattaches": stats["daemon_reattaches"],
                      "inline": args.inline, "quota": args.quota or 0,
                      "spilled": stats.get("bytes_spilled", 0),
                      "from_source": stats["unpacked_from_source"],
                      "step_ms_median": 1e3 * statistics.median(times),
                      "step_ms_max": 1e3 * max(times)}))


if __name__ == "__main__":
    main()
