#!/usr/bin/env python3
"""copy_share_bench: several trainer processes on one actstashd, each planning with
wrap(policy="auto"), with the daemon's node copy share off (each plans with what its
probe saw) and on (--copy-bandwidth auto: the daemon measures memcpy over every core and
divides it among the sessions copying at once).

    bench/copy_share_bench.py                       # 1, 2 and 4 trainers, off and auto
    bench/copy_share_bench.py --trainers 2 --quick  # a smoke run

Each trainer: the GPT of scripts/demo (--layers x --dim, batch --batch x --context),
fp32, CPU, one torch thread. It times --plain-steps of plain autograd (its baseline, in
the same process and run), profiles under an unlimited budget to learn the peaks any
plan reaches, then plans under the budget a quarter of the way from the smallest peak
to the kept one (a plan that must offload or recompute) and runs --warmup steps; then,
once every trainer got there, --settle untimed steps (a plan may follow the share now
that all copy) and --steps timed ones.

Rows: "together": all trainers plan at once (their probes run at the same time, so
each probe already sees the others); "staggered": trainer 0 plans alone before the
others start (its probe saw the machine to itself: the case the share is for).

Printed per trainer: the probe's store/fetch rates, the daemon's share (node figure over
copying sessions), the store rate planned with when the plan was made and at the end,
the choices, plain and auto step medians and their ratio. Timings on a shared machine
are noisy: compare rows of one run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "testing", "python"))
from actstash_testing.memory import MMAP_THRESHOLD_ENV  # noqa: E402
from actstash_testing.paths import BUILD_PYTHON, EXAMPLES, TESTING_PYTHON  # noqa: E402
from hook_bench import start_daemon  # noqa: E402


def wait_for(path, deadline_s=600):
    end = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"copy_share_bench: {path} did not appear in {deadline_s} s")
        time.sleep(0.01)


def barrier(folder, name, index):
    """Says this trainer reached `name`, then waits for the parent's go to it."""
    open(os.path.join(folder, f"{name}.{index}"), "w").close()
    wait_for(os.path.join(folder, f"{name}.go.{index}"))


def child(args):
    import torch

    import actstash
    from gpt import GPT, loss_fn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(vocab=256, dim=args.dim, heads=4, layers=args.layers, context=args.context)
    batch = torch.randint(0, 256, (args.batch, args.context + 1),
                          generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss_fn(model, batch).backward()
        return time.perf_counter() - start

    step()
    plain = statistics.median(step() for _ in range(args.plain_steps))
    stash = actstash.connect(args.child)
    barrier(args.folder, "plan", args.index)
    actstash.wrap(model, stash, policy="auto", budget=1 << 40)
    for _ in range(2):
        step()
    fits = stash.plan()
    actstash.unwrap(model)
    budget = fits.smallest_peak + (fits.kept_peak - fits.smallest_peak) // 4
    actstash.wrap(model, stash, policy="auto", budget=budget)
    for _ in range(args.warmup):
        step()
    planned = stash.plan()
    barrier(args.folder, "train", args.index)
    for _ in range(args.settle):  # the others copy now: a plan may follow the share
        step()
    timed = statistics.median(step() for _ in range(args.steps))
    report = stash.plan()
    stash.synchronize()
    print(json.dumps({"plain_s": plain, "auto_s": timed, "budget": budget,
                      "planned_choices": planned.choices, "planned_rates": planned.copy_rates,
                      "choices": report.choices, "rates": report.copy_rates,
                      "offloaded": stash.stats()["bytes_offloaded"]}))
    actstash.unwrap(model)
    stash.close()


def run_row(args, socket, n, stagger):
    """n trainers; with `stagger`, trainer 0 plans alone before the others start."""
    env = dict(os.environ, **MMAP_THRESHOLD_ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [env.get("PYTHONPATH"), BUILD_PYTHON, EXAMPLES, TESTING_PYTHON]))
    with tempfile.TemporaryDirectory(prefix="actstash-share-") as folder:
        common = ["--dim", str(args.dim), "--layers", str(args.layers), "--context",
                  str(args.context), "--batch", str(args.batch), "--steps", str(args.steps),
                  "--warmup", str(args.warmup), "--settle", str(args.settle),
                  "--plain-steps", str(args.plain_steps), "--folder", folder]
        procs = [subprocess.Popen([sys.executable, __file__, "--child", socket, "--index", str(i)]
                                  + common, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(n)]

        def release(name, indices):
            for i in indices:
                wait_for(os.path.join(folder, f"{name}.{i}"))
            for i in indices:
                open(os.path.join(folder, f"{name}.go.{i}"), "w").close()

        groups = [[0], list(range(1, n))] if stagger and n > 1 else [list(range(n))]
        for group in groups:
            release("plan", group)
            for i in group:  # planned
                wait_for(os.path.join(folder, f"train.{i}"))
        release("train", range(n))
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise SystemExit(f"copy_share_bench: a trainer failed:\n{stderr}")
            outs.append(json.loads(stdout))
    return outs


def mbps(rates, key):
    return f"{rates[key] / 1e6:.0f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trainers", default="1,2,4")
    parser.add_argument("--modes", default="off,auto", help="--copy-bandwidth values")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--plain-steps", type=int, default=4)
    parser.add_argument("--settle", type=int, default=4,
                        help="untimed steps once all trainers train (a plan may follow)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.dim, args.layers, args.context, args.steps, args.warmup, args.plain_steps = (
            64, 3, 64, 2, 3, 2)
        args.settle = 3
    print(f"copy_share_bench: GPT {args.layers}x{args.dim}, batch {args.batch}x{args.context}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print("start: together (all plan at once) or staggered (trainer 0 plans alone first); "
          "rates in MB/s; planned: when its plan was made / at the end")
    print(f"{'share':<5} {'start':<9} {'n':>1} {'#':>1} {'probe st/fe':>13} "
          f"{'share (sessions)':>16} {'planned':>11} {'plain ms':>8} {'auto ms':>8} "
          f"{'x plain':>7}  choices at the end")
    for mode in args.modes.split(","):
        daemon = start_daemon(extra=("--copy-bandwidth", mode))
        try:
            for n in (int(t) for t in args.trainers.split(",")):
                for stagger in ([False, True] if n > 1 else [False]):
                    for i, out in enumerate(run_row(args, daemon.socket, n, stagger)):
                        r, p = out["rates"], out["planned_rates"]
                        share = (f"{r['share_bps'] / 1e6:.0f} ({r['copying_sessions']})"
                                 if r["share_bps"] else "-")
                        changed = "" if out["choices"] == out["planned_choices"] else \
                            f" (planned: {', '.join(out['planned_choices'])})"
                        print(f"{mode:<5} {'staggered' if stagger else 'together':<9} {n:>1} "
                              f"{i:>1} {mbps(p, 'probe_store_bps'):>6}/"
                              f"{mbps(p, 'probe_fetch_bps'):<6} {share:>16} "
                              f"{mbps(p, 'store_bps'):>5}/{mbps(r, 'store_bps'):<5} "
                              f"{out['plain_s'] * 1e3:>8.1f} {out['auto_s'] * 1e3:>8.1f} "
                              f"{out['auto_s'] / out['plain_s']:>7.2f}  "
                              f"{', '.join(out['choices'])}{changed}", flush=True)
        finally:
            daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
