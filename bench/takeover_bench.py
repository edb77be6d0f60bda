"""The pause of a take-over (actstashd --take-over) under training load: TRAINERS
trainer processes (tests/python/takeover_run.py: a GPT with offloaded blocks,
every step checked bitwise against plain autograd) attached to one daemon while
it is replaced HANDOVERS times, one every INTERVAL seconds.

Per hand-over, the gap the socket served no call (the old daemon's "take-over
requested" to the successor's "listening on", from their logs); per trainer,
its median step and its slowest step (the steps that met a gap), and the calls
that paused. Also a baseline: the same trainers for the same time with no
hand-over, in the same run.

    python3 bench/takeover_bench.py [--trainers 4] [--handovers 20] [--interval 1.0]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "testing", "python"))
from actstash_testing.daemon import DaemonProcess  # noqa: E402
from actstash_testing.paths import BUILD_PYTHON, BUILT_DAEMON  # noqa: E402

RUNNER = os.path.join(ROOT, "tests", "python", "takeover_run.py")


def run(trainers, handovers, interval, dim):
    """One round; returns (gaps, trainer results)."""
    daemon = DaemonProcess(os.environ.get("ACTSTASH_DAEMON_BINARY", BUILT_DAEMON), "1GiB",
                           segment="4MiB", prefix="actstash-bench-")
    work = tempfile.mkdtemp(prefix="actstash-takeover-")
    env = dict(os.environ, PYTHONPATH=BUILD_PYTHON)
    stop = os.path.join(work, "stop")
    procs = [subprocess.Popen([sys.executable, RUNNER, daemon.socket, stop,
                               os.path.join(work, f"ready{i}"), "--dim", str(dim)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(trainers)]
    try:
        while not all(os.path.exists(os.path.join(work, f"ready{i}")) for i in range(trainers)):
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a trainer failed: " + procs[0].communicate()[1][-2000:])
            time.sleep(0.05)
        gaps = []
        time.sleep(interval)
        for _ in range(handovers):
            gaps.append(daemon.take_over())
            time.sleep(interval)
        if not handovers:
            time.sleep(interval * 20)
        open(stop, "w").close()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            if p.returncode != 0:
                raise SystemExit("a trainer failed: " + err[-3000:])
            results.append(json.loads(out.strip().splitlines()[-1]))
        return gaps, results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        daemon.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--handovers", type=int, default=20)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    base_gaps, base = run(args.trainers, 0, args.interval, args.dim)
    gaps, results = run(args.trainers, args.handovers, args.interval, args.dim)
    ms = sorted(1e3 * g for g in gaps)
    print(f"{args.trainers} trainers, {args.handovers} take-overs, one every {args.interval} s")
    print(f"gap (socket serving no call): median {statistics.median(ms):.1f} ms, "
          f"max {ms[-1]:.1f} ms, min {ms[0]:.1f} ms")
    print(f"{'':10}{'steps':>7}{'not bitwise':>13}{'offloaded':>11}{'fetched':>9}"
          f"{'pauses':>8}{'median ms':>11}{'max ms':>9}")
    for name, rows in (("baseline", base), ("take-over", results)):
        for r in rows:
            print(f"{name:10}{r['steps']:>7}{r['not_bitwise']:>13}{r['offloaded']:>11}"
                  f"{r['fetched']:>9}{r['pauses']:>8}{r['step_ms_median']:>11.1f}"
                  f"{r['step_ms_max']:>9.1f}")
    lost = sum(r["offloaded"] - r["fetched"] for r in results)
    bad = sum(r["not_bitwise"] for r in results) + sum(r["failures"] for r in results)
    ratio = (statistics.median(r["step_ms_median"] for r in results) /
             statistics.median(r["step_ms_median"] for r in base))
    print(f"lost tensors {lost}, steps not bitwise or failed stores {bad}; median step "
          f"with take-overs / without: {ratio:.3f}")
    return 1 if lost or bad else 0


if __name__ == "__main__":
    sys.exit(main())
