"""What the state table costs the inline data path: inline_bench against a
daemon that keeps no state table (no service manager) and against the same
daemon run by a service manager (actstash_testing.supervisor: $NOTIFY_SOCKET
set, so it writes every inline object's record to its state table as the
object is stored, moved by a spill, read back or deleted), interleaved in one
run, same flags.

Per object size, the median over RUNS of inline_bench's Put and Get GB/s (each
itself a median of its repetitions) on each daemon and the ratio journaled /
plain; then the p50 latency of 4 KiB Put, Get and Delete, and the ratio.
A ratio below 1.0 for GB/s (above 1.0 for latency) is the journal's cost.

    python3 bench/journal_bench.py [--runs 5] [--sizes 4KiB,64KiB,1MiB,16MiB]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "testing", "python"))
from actstash_testing.daemon import DaemonProcess  # noqa: E402
from actstash_testing.paths import BUILD, BUILT_DAEMON  # noqa: E402
from actstash_testing.supervisor import SupervisedDaemon  # noqa: E402

THROUGHPUT = re.compile(r"^(\d+ [KMG]iB)\s+\d+\s+([\d.]+)\s+([\d.]+)\s", re.M)
LATENCY = re.compile(r"^\s+(Put|Get|Delete)\s+([\d.]+)\s", re.M)


def inline_bench(binary, socket, sizes, reps, latency_iters):
    out = subprocess.run(
        [binary, "--address", "unix://" + socket, "--sizes", sizes, "--reps", str(reps),
         "--latency-iters", str(latency_iters)],
        check=True, capture_output=True, text=True, timeout=600).stdout
    put_get = {size: (float(put), float(get)) for size, put, get in THROUGHPUT.findall(out)}
    latency = {op: float(p50) for op, p50 in LATENCY.findall(out)}
    if not put_get or len(latency) != 3:
        raise RuntimeError("inline_bench printed no figures:\n" + out)
    return put_get, latency


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB")
    parser.add_argument("--reps", type=int, default=3, help="inline_bench --reps")
    parser.add_argument("--latency-iters", type=int, default=2000)
    parser.add_argument("--pool", default="1GiB")
    args = parser.parse_args()
    binary = os.environ.get("ACTSTASH_DAEMON_BINARY", BUILT_DAEMON)
    bench = os.path.join(BUILD, "bench", "inline_bench")
    if not os.path.exists(bench):
        sys.exit(f"journal_bench: {bench} is not built (ACTSTASH_BUILD_BENCH=ON)")

    plain = DaemonProcess(binary, args.pool, segment="4MiB", prefix="actstash-bench-")
    journaled = SupervisedDaemon(binary, args.pool, segment="4MiB", prefix="actstash-bench-")
    results = {"plain": [], "journaled": []}
    try:
        for _ in range(args.runs):
            for name, daemon in (("plain", plain), ("journaled", journaled)):
                results[name].append(
                    inline_bench(bench, daemon.socket, args.sizes, args.reps, args.latency_iters))
        journaled_log = journaled.text()
    finally:
        plain.stop()
        journaled.stop()
    if "state table" not in journaled_log:
        sys.exit("journal_bench: the supervised daemon did not say it keeps a state table:\n"
                 + journaled_log)

    def median(name, pick):
        return statistics.median(pick(r) for r in results[name])

    print(f"inline_bench, {args.runs} runs interleaved, medians; GB/s = 1e9 B/s")
    print(f"{'size':<10}{'Put plain':>11}{'journaled':>11}{'ratio':>8}"
          f"{'Get plain':>11}{'journaled':>11}{'ratio':>8}")
    for size in results["plain"][0][0]:
        row = [median(n, lambda r: r[0][size][i]) for i in (0, 1) for n in ("plain", "journaled")]
        print(f"{size:<10}{row[0]:>11.3f}{row[1]:>11.3f}{row[1] / row[0]:>8.3f}"
              f"{row[2]:>11.3f}{row[3]:>11.3f}{row[3] / row[2]:>8.3f}")
    print(f"\np50 latency, 4 KiB, {args.latency_iters} rounds per run (microseconds)")
    print(f"{'operation':<10}{'plain':>11}{'journaled':>11}{'ratio':>8}")
    for op in ("Put", "Get", "Delete"):
        a, b = median("plain", lambda r: r[1][op]), median("journaled", lambda r: r[1][op])
        print(f"{op:<10}{a:>11.1f}{b:>11.1f}{b / a:>8.3f}")


if __name__ == "__main__":
    main()
