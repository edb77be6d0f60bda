#!/usr/bin/env python3
"""reclaim_bench: the step time of a trainer beside an idle process that holds most
of the daemon's pool, against the same trainer alone, with a spill tier: what the
pool asking idle sessions back costs the active one.

    bench/reclaim_bench.py                 # a private daemon, spill dir /var/tmp
    bench/reclaim_bench.py --quick

The holder (tests/python/holder_run.py) stores --holder-layers x 16 MiB of
activations (an MLP of width 1024, batch 2048, fp32) and sleeps holding them;
the trainer runs --steps steps of a 3-layer MLP of the same shapes (48 MiB of
activations a step) through stash.offload(), each step's gradients compared
bitwise with plain autograd's (exit 1 otherwise). Per round: the trainer alone,
then beside a fresh holder, then alone again; medians over rounds of the
per-step time (the first step beside the holder, which waits for the holder's
next usage report, is reported on its own). One torch thread each.
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "testing", "python"))
from hook_bench import import_actstash, start_daemon  # noqa: E402


def steps(torch, actstash, socket, count):
    """Per-step seconds of `count` steps of the trainer, and whether each was bitwise."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                      torch.nn.Tanh()) for _ in range(3)])
    plain = copy.deepcopy(model)
    times, bitwise = [], []
    with actstash.connect(socket) as stash:
        for step in range(count):
            x = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(10 + step))
            start = time.perf_counter()
            model.zero_grad()
            with stash.offload():
                loss = model(x).square().mean()
            loss.backward()
            times.append(time.perf_counter() - start)
            plain.zero_grad()
            plain(x).square().mean().backward()
            bitwise.append(all(torch.equal(a.grad, b.grad)
                               for a, b in zip(model.parameters(), plain.parameters())))
    return times, bitwise


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spill-dir", default="/var/tmp")
    parser.add_argument("--pool", default="96MiB")
    parser.add_argument("--holder-layers", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--actstashd", default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 2, 1
    import torch
    actstash = import_actstash()
    torch.set_num_threads(1)
    daemon = start_daemon(args.actstashd, pool=args.pool, segment="4MiB",
                          extra=("--spill-dir", args.spill_dir))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [os.path.dirname(actstash.__path__[0]), os.environ.get("PYTHONPATH")])))
    alone, beside, first, given, ok = [], [], [], [], True
    try:
        for _ in range(args.rounds):
            t, b = steps(torch, actstash, daemon.socket, args.steps)
            alone.append(statistics.median(t))
            ok &= all(b)
            holder = subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "tests", "python", "holder_run.py"),
                 daemon.socket, str(args.holder_layers)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, env=env)
            holding = json.loads(holder.stdout.readline())["holding"]
            t, b = steps(torch, actstash, daemon.socket, args.steps)
            first.append(t[0])
            beside.append(statistics.median(t[1:]) if len(t) > 1 else t[0])
            ok &= all(b)
            out, _ = holder.communicate("go\n", timeout=600)
            result = json.loads(out.strip().splitlines()[-1])
            ok &= result["bitwise"]
            given.append(result["reclaim_bytes_given"])
            t, b = steps(torch, actstash, daemon.socket, args.steps)
            alone.append(statistics.median(t))
            ok &= all(b)
    finally:
        daemon.stop()
    a, s = statistics.median(alone), statistics.median(beside)
    print(f"reclaim_bench: pool {args.pool}, holder {holding / 2**20:.0f} MiB asleep, trainer "
          f"48 MiB a step, {args.rounds} rounds x {args.steps} steps")
    print(f"  trainer alone          {a * 1e3:8.1f} ms/step")
    print(f"  beside the holder      {s * 1e3:8.1f} ms/step   {s / a:.2f}x alone")
    print(f"  its first step beside  {statistics.median(first) * 1e3:8.1f} ms   "
          f"{statistics.median(first) / a:.2f}x alone (waits for the holder's next report)")
    print(f"  the holder gave back   {statistics.median(given) / 2**20:8.1f} MiB per round; "
          f"every step bitwise: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
