"""The pause of a take-over (actstashd --take-over) under training load: TRAINERS
trainer processes (tests/python/takeover_run.py: a GPT with offloaded blocks,
every step checked bitwise against plain autograd) attached to one daemon while
it is replaced HANDOVERS times, one every INTERVAL seconds.

Per hand-over, the gap the socket served no call (the old daemon's "take-over
requested" to the successor's "listening on", from their logs); per trainer,
its median step and its slowest step (the steps that met a gap), and the calls
that paused. Also a baseline: the same trainers for the same time with no
hand-over, in the same run.

--stores mixed (the default for take-overs) gives the daemon a spill tier and
cycles the trainers through four kinds: zero-copy, zero-copy under an 8 MiB quota
(its blocks spill), inline (Put/Get, no attach connection), inline under the
quota (the daemon spills its objects); --stores zero-copy runs them all
zero-copy.

With --crash the daemon runs under a service manager that keeps its fds
(actstash_testing.supervisor) and each replacement is a SIGKILL and a restart
that recovers the state; the gap is then from the SIGKILL to the restarted
daemon's READY=1, and the trainers count their reattachments.

With --reload the daemon runs under that service manager too and each
replacement is an upgrade in place: SIGUSR2 (what `systemctl reload` sends),
on which the daemon starts its successor itself; the gap is measured as for
take-overs.

    python3 bench/takeover_bench.py [--trainers 4] [--handovers 20] [--interval 1.0]
        [--stores mixed|zero-copy] [--crash | --reload]
"""
import argparse
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "testing", "python"))
from actstash_testing.daemon import DaemonProcess  # noqa: E402
from actstash_testing.paths import BUILD_PYTHON, BUILT_DAEMON  # noqa: E402
from actstash_testing.supervisor import SupervisedDaemon  # noqa: E402
from actstash_testing.trainers import Trainers  # noqa: E402


QUOTA = ("--quota", str(8 << 20))
KINDS = [(), QUOTA, ("--inline",), ("--inline", *QUOTA)]


def run(trainers, handovers, interval, dim, crash=False, mixed=False, reload=False):
    """One round; returns (gaps, trainer results, per take-over (objects, files))."""
    binary = os.environ.get("ACTSTASH_DAEMON_BINARY", BUILT_DAEMON)
    work = tempfile.mkdtemp(prefix="actstash-takeover-")
    extra = ()
    if mixed:
        os.mkdir(os.path.join(work, "spill"))
        extra = ("--spill-dir", os.path.join(work, "spill"))
    daemon = (SupervisedDaemon(binary, "1GiB", segment="4MiB", extra=extra,
                               prefix="actstash-bench-") if crash or reload
              else DaemonProcess(binary, "1GiB", segment="4MiB", extra=extra,
                                 prefix="actstash-bench-"))
    group = None
    try:
        each = [KINDS[i % len(KINDS)] if mixed else () for i in range(trainers)]
        group = Trainers(daemon.socket, trainers, work,
                         env=dict(os.environ, PYTHONPATH=BUILD_PYTHON), extra=("--dim", str(dim)),
                         each=each)
        gaps = []
        time.sleep(interval)
        for _ in range(handovers):
            gaps.append(daemon.crash() if crash else
                        daemon.upgrade() if reload else daemon.take_over())
            time.sleep(interval)
        if not handovers:
            time.sleep(interval * 20)
        handed = [tuple(map(int, m)) for m in re.findall(
            r"took over \d+ sessions, \d+ leases, (\d+) inline objects and (\d+) spill files",
            daemon.text())]
        return gaps, group.finish(timeout=300), handed
    finally:
        if group is not None:
            group.kill()
        daemon.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--handovers", type=int, default=20)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--crash", action="store_true",
                        help="SIGKILL and restart under a service manager instead")
    parser.add_argument("--reload", action="store_true",
                        help="upgrades in place (SIGUSR2) under a service manager instead")
    parser.add_argument("--stores", choices=("mixed", "zero-copy"), default=None,
                        help="mixed: zero-copy and inline, each with and without spilling "
                        "(default for take-overs; inline objects and spilled data do not "
                        "survive a crash)")
    args = parser.parse_args()
    stores = args.stores or ("zero-copy" if args.crash else "mixed")
    if args.crash and stores == "mixed":
        parser.error("--crash keeps leased memory only: use --stores zero-copy")
    if args.crash and args.reload:
        parser.error("--crash or --reload, not both")
    mixed = stores == "mixed"
    _, base, _ = run(args.trainers, 0, args.interval, args.dim, args.crash, mixed, args.reload)
    gaps, results, handed = run(args.trainers, args.handovers, args.interval, args.dim,
                                args.crash, mixed, args.reload)
    ms = sorted(1e3 * g for g in gaps)
    what = ("crashes (SIGKILL, restart)" if args.crash else
            "upgrades in place (SIGUSR2)" if args.reload else "take-overs")
    print(f"{args.trainers} trainers ({stores} stores), {args.handovers} {what}, one every "
          f"{args.interval} s")
    gap = ("SIGKILL to the restarted daemon's READY=1" if args.crash
           else "socket serving no call")
    print(f"gap ({gap}): median {statistics.median(ms):.1f} ms, "
          f"max {ms[-1]:.1f} ms, min {ms[0]:.1f} ms")
    if handed:
        objects = sorted(h[0] for h in handed)
        files = sorted(h[1] for h in handed)
        print(f"handed per take-over: inline objects median {statistics.median(objects):g} "
              f"(max {objects[-1]}), spill files median {statistics.median(files):g} "
              f"(max {files[-1]})")
    name = "crash" if args.crash else "reload" if args.reload else "take-over"
    print(f"{'':10}{'kind':>16}{'steps':>7}{'not bitwise':>13}{'offloaded':>11}{'fetched':>9}"
          f"{'source':>8}{'spilled MiB':>13}{'pauses':>8}{'reattach':>9}{'median ms':>11}"
          f"{'max ms':>9}")
    for label, rows in (("baseline", base), (name, results)):
        for r in rows:
            kind = ("inline" if r["inline"] else "zero-copy") + ("+spill" if r["quota"] else "")
            print(f"{label:10}{kind:>16}{r['steps']:>7}{r['not_bitwise']:>13}{r['offloaded']:>11}"
                  f"{r['fetched']:>9}{r['from_source']:>8}{r['spilled'] / 2**20:>13.1f}"
                  f"{r['pauses']:>8}{r['reattaches']:>9}"
                  f"{r['step_ms_median']:>11.1f}{r['step_ms_max']:>9.1f}")
    lost = sum(r["offloaded"] - r["fetched"] - r["from_source"] for r in results)
    bad = sum(r["not_bitwise"] for r in results) + sum(r["failures"] for r in results)
    ratio = (statistics.median(r["step_ms_median"] for r in results) /
             statistics.median(r["step_ms_median"] for r in base))
    print(f"lost tensors {lost}, steps not bitwise or failed stores {bad}; median step "
          f"with {what} / without: {ratio:.3f}")
    return 1 if lost or bad else 0


if __name__ == "__main__":
    sys.exit(main())
