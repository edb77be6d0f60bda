#!/usr/bin/env python3
"""spill_step_bench: a training step whose offloaded activations are --factor times
the daemon's pool (so most of them go through the spill tier), next to the same
step with a pool big enough for all of them, plain autograd and torch checkpointing
(use_reentrant=False per block), in one process, variants interleaved per round.

    bench/spill_step_bench.py                 # private daemons, spill dir /var/tmp
    bench/spill_step_bench.py --quick         # a smoke run
    bench/spill_step_bench.py --spill-dir D   # spill to D

Model: examples/gpt.py's GPT, 6 blocks, width 256, 4 heads, vocabulary 256, batch
8 x 256 tokens, fp32 on CPU, dropout 0, one torch thread (actstash_testing's
spill_gpt and spill_batch, which tests/python/test_spill.py trains). Every saved tensor of at
least 64 KiB goes through stash.offload(). A step is zero_grad, forward, backward;
the median of --steps timed steps (after one untimed) per variant and round, and
"x plain" is the median over rounds of the per-round ratio. Gradients of every
offload step are compared bitwise with plain autograd's of the same step (exit 1
otherwise). For the spilling variant the stash's counters give, per step: bytes
spilled and read back, how long stores waited for spills and fetches for restores,
and the share of restores read back ahead of the fetch that needed them (what
prefetch hides).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "testing", "python"))
from actstash_testing.paths import EXAMPLES  # noqa: E402
from actstash_testing.training import (bitwise_equal, cloned_grads, spill_batch,  # noqa: E402
                                       spill_gpt)
from hook_bench import import_actstash, start_daemon  # noqa: E402

sys.path.insert(0, EXAMPLES)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spill-dir", default="/var/tmp")
    parser.add_argument("--factor", type=float, default=3.0,
                        help="offloaded bytes per step over the small pool (default 3)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--actstashd", default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 1, 1

    import torch
    from gpt import GPT, Block, loss_fn
    from torch.utils.checkpoint import checkpoint
    actstash = import_actstash()
    torch.set_num_threads(1)
    layers = 2 if args.quick else 6

    def make():
        return spill_gpt(GPT, layers)

    def checkpointed(model):
        for block in model.modules():
            if isinstance(block, Block):
                forward = block.forward
                block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(
                    forward)
        return model

    # How much one step offloads, to size the small pool.
    big = start_daemon(args.actstashd, pool="2GiB", segment="4MiB")
    stash_big = actstash.connect(big.socket)
    model = make()
    with stash_big.offload():
        loss = loss_fn(model, spill_batch(0))
    loss.backward()
    per_step = stash_big.stats()["bytes_offloaded"]
    seg = 4 << 20
    pool = max(4 * seg, int(per_step / args.factor) // seg * seg)
    spill_dir = tempfile.mkdtemp(prefix="actstash-spill-bench-", dir=args.spill_dir)
    small = start_daemon(args.actstashd, pool=f"{pool >> 20}MiB", segment="4MiB",
                         extra=("--spill-dir", spill_dir))
    stash_small = actstash.connect(small.socket)

    plain_grads = {}
    failures = []

    def step(variant, model, k):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if variant in ("offload", "offload+spill"):
            stash = stash_big if variant == "offload" else stash_small
            with stash.offload():
                loss = loss_fn(model, spill_batch(k))
        else:
            loss = loss_fn(model, spill_batch(k))
        loss.backward()
        elapsed = time.perf_counter() - start
        grads = cloned_grads(model)
        if variant == "plain":
            plain_grads[k] = grads
        elif variant != "checkpoint" and k in plain_grads:
            if not bitwise_equal(grads, plain_grads[k]):
                failures.append(f"{variant} step {k}: gradients differ from plain autograd")
        return elapsed

    variants = ["plain", "checkpoint", "offload", "offload+spill"]
    models = {v: (checkpointed(make()) if v == "checkpoint" else make()) for v in variants}
    times = {v: [] for v in variants}
    ratios = {v: [] for v in variants}
    spill_before = stash_small.stats()
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        order.remove("plain")
        order.insert(0, "plain")  # plain first: its gradients are the reference
        this_round = {}
        for v in order:
            step(v, models[v], 1000)  # untimed
            samples = [step(v, models[v], 1000 + s + 1) for s in range(args.steps)]
            this_round[v] = statistics.median(samples)
            times[v].append(this_round[v])
        for v in variants:
            ratios[v].append(this_round[v] / this_round["plain"])
    s = stash_small.stats()
    steps_small = args.rounds * (args.steps + 1)
    per = lambda key: (s[key] - spill_before[key]) / steps_small  # noqa: E731

    print(f"spill_step_bench: GPT {layers} blocks, width 256, batch 8x256, fp32 CPU, 1 thread; "
          f"{per_step / 2**20:.0f} MiB offloaded per step; small pool {pool >> 20} MiB "
          f"({per_step / pool:.1f}x over-subscribed), big pool 2 GiB; spill dir {args.spill_dir}; "
          f"{args.rounds} rounds x {args.steps} steps (medians)")
    print(f"  {'variant':<16} {'step ms':>9} {'x plain':>8}")
    for v in variants:
        print(f"  {v:<16} {1e3 * statistics.median(times[v]):9.1f} "
              f"{statistics.median(ratios[v]):8.2f}")
    spill_ratio = statistics.median([a / b for a, b in zip(times["offload+spill"],
                                                           times["offload"])])
    print(f"  offload+spill vs offload with a big pool: {spill_ratio:.2f}x")
    print(f"  per step (offload+spill): spilled {per('bytes_spilled') / 2**20:.0f} MiB, read back "
          f"{per('bytes_restored') / 2**20:.0f} MiB; stores waited "
          f"{1e3 * per('spill_wait_seconds'):.1f} ms for spills, fetches waited "
          f"{1e3 * per('restore_wait_seconds'):.1f} ms for restores")
    restores = s["restores"] - spill_before["restores"]
    ahead = s["restores_ahead"] - spill_before["restores_ahead"]
    print(f"  restores read back ahead of need: {ahead} of {restores}")
    daemon = stash_small.client.stats()["spill"]
    if daemon["write_seconds"] > 0 and daemon["read_seconds"] > 0:
        writes = daemon["bytes_written"] / daemon["write_seconds"] / 1e6
        reads = daemon["bytes_read"] / daemon["read_seconds"] / 1e6
        print(f"  daemon: {daemon['io_mode']}, writes {writes:.0f} MB/s, reads {reads:.0f} MB/s "
              "per segment")
    if per("bytes_spilled") <= 0:
        failures.append("nothing was spilled")
    for f in failures:
        print("FAILED: " + f)
    stash_small.close()
    stash_big.close()
    small.stop()
    big.stop()
    os.rmdir(spill_dir)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
