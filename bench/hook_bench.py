#!/usr/bin/env python3
"""hook_bench: what actstash's saved-tensor hooks cost per saved tensor, and
how fast one large activation goes to actstashd and back, next to baselines
measured in the same process.

    bench/hook_bench.py                    # starts a private actstashd
    bench/hook_bench.py --quick            # a smoke run (a few seconds)
    bench/hook_bench.py --address SOCKET   # an actstashd already running
    bench/hook_bench.py --json             # machine-readable output

Part 1, per saved tensor (sizes 4 KiB and 64 KiB by default): a chain of
`--tensors` torch.relu ops on a 1-D fp32 tensor of that size. relu saves
exactly one tensor, its result (checked: a counting hook sees --tensors packs,
and actstash's counters must show --tensors tensors offloaded and fetched).
One timed run is: forward of the chain (inside the variant's hooks), then
backward (torch.autograd.backward with a fixed gradient), graph freed. For the
actstash variants the run also calls stash.synchronize() between forward and
backward (every store has landed in the daemon's pool, so backward must fetch)
and after backward (the releases are done): both are inside the timed
interval. Variants, interleaved in every repetition (order rotated):
  plain          no hooks
  identity       saved_tensors_hooks(lambda t: t, lambda t: t)
  clone          saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
  actstash       stash.offload(min_bytes=0), connect(cpu_views=True):
                 backward reads the daemon's shared memory in place
  actstash-copy  the same with connect(cpu_views=False): fetched into fresh
                 tensors (prefetched)
"extra us" is (run time - plain run time of the same repetition) / tensors,
median over repetitions; "x plain" is the median of the per-repetition time
ratios; "extra x identity" / "x clone" divide the extra by the identity /
clone hook's extra of the same repetition (median of the ratios).

Part 2, one large activation (64 MiB by default): y = relu(x), forward inside
the hooks, stash.synchronize(), backward, stash.synchronize(). The store and
fetch cost is the run's time minus the plain run's time of the same
repetition; effective GB/s = activation bytes / that extra time (10^9 B/s).
Baselines, timed in the same repetition on the same bytes:
  copy out + copy into fresh  staging.copy_(a) into a pre-touched buffer,
                              then torch.empty(...).copy_(staging) (the
                              destination's pages fault during the copy)
  two pre-faulted copies      staging.copy_(a); dst.copy_(staging)
  one pre-faulted copy        staging.copy_(a) (what the cpu_views path
                              must at least do: it fetches without a copy)
Ratios are per repetition (baseline time / extra time = actstash GB/s over
baseline GB/s), median over repetitions.

Memory: by default (--malloc tuned) the benchmark turns glibc's heap trimming
off and fixes its mmap threshold at 32 MiB before torch allocates anything.
Blocks up to 32 MiB are then reused already faulted in (part 1 measures the
hooks, not page faults: with trimming, every run of a 64 KiB chain faults
its memory in again, and a variant that frees saved tensors early skips
that), and blocks above it (part 2's 64 MiB) are fresh mmaps every time, for
plain autograd and the baselines alike. Keep --big-size above 32 MiB, or
"fresh" is not fresh. --malloc default leaves glibc as it is.

Checks: the warm-up run of every variant must give plain autograd's gradient
bit for bit, and every actstash run is checked against the engine's counters
(tensors/bytes offloaded and fetched, views, nothing kept, nothing read from
the source, live tensors/bytes back to 0 once the graph is freed); the
benchmark prints its results and then exits 1 if any check failed.
"""
import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "testing", "python"))
from actstash_testing.daemon import DaemonError, DaemonProcess  # noqa: E402
from actstash_testing.paths import BUILD_PYTHON, BUILT_DAEMON  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20


def import_actstash():
    """actstash from PYTHONPATH, else from the build tree."""
    try:
        import actstash
    except ImportError:
        sys.path.insert(0, BUILD_PYTHON)
        import actstash
    return actstash


def parse_size(text):
    """'4K', '64KiB', '64M', '1048576' -> bytes."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    scale = 1
    for suffix, s in (("K", KIB), ("M", MIB), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, scale = t[:-1], s
            break
    return int(float(t) * scale)


def fmt_size(n):
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB} MiB"
    if n >= KIB and n % KIB == 0:
        return f"{n // KIB} KiB"
    return f"{n} B"


def start_daemon(binary=None, pool="2GiB", segment=None, extra=()):
    """A private actstashd for the run (actstash_testing's DaemonProcess, as the
    tests start it, at log level info: finish() reports its warnings); binary:
    default $ACTSTASH_DAEMON_BINARY, else the build tree's. Exits with its log when it
    does not start."""
    binary = binary or os.environ.get("ACTSTASH_DAEMON_BINARY") or BUILT_DAEMON
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"no actstashd at {binary}: build the project (scripts/setup) "
                         "or pass --actstashd / --address")
    try:
        return DaemonProcess(binary, pool, segment=segment, extra=extra, log_level="info",
                             prefix="actstash-bench-")
    except DaemonError as error:
        raise SystemExit(str(error)) from None


@contextlib.contextmanager
def daemon_address(args):
    """The socket to connect to: --address, or a private daemon for the run."""
    if args.address:
        yield args.address, None
        return
    daemon = start_daemon(args.actstashd, pool=args.pool_size)
    try:
        yield daemon.socket, daemon
    finally:
        daemon.stop()


class Checks:
    """Counter checks: collected, printed, and turned into the exit status."""

    def __init__(self):
        self.failures = []
        self.count = 0

    def expect(self, what, got, want):
        self.count += 1
        if got != want:
            self.failures.append(f"{what}: got {got}, expected {want}")

    def delta(self, label, before, after, expected):
        for key, want in expected.items():
            self.expect(f"{label}: {key} grew by", after[key] - before[key], want)

    def absolute(self, label, stats, expected):
        for key, want in expected.items():
            self.expect(f"{label}: {key}", stats[key], want)


def print_checks(checks, what, passed_note=""):
    """Prints a report's checks (the JSON form: {"failures": [...], "count": n})."""
    if checks["failures"]:
        print(f"{what}: {len(checks['failures'])} of {checks['count']} FAILED")
        for f in checks["failures"][:20]:
            print("  " + f)
    else:
        print(f"{what}: all {checks['count']} passed{passed_note}")


def scalar_stats(stash):
    """stash.stats() without its non-scalar entries, for the JSON report."""
    return {k: v for k, v in stash.stats().items()
            if isinstance(v, (int, float, bool)) or v is None}


def finish(result, checks, daemon, args, print_report):
    """Adds the checks (and a private daemon's warnings) to `result`, prints it
    (JSON or the report) and returns the exit code: 1 when a check failed."""
    if daemon is not None:
        result["daemon_warnings"] = daemon.warnings()
    result["checks"] = {"count": checks.count, "failures": checks.failures}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result)
        for line in result.get("daemon_warnings", []):
            print("actstashd: " + line)
    return 1 if checks.failures else 0


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def tune_malloc():
    """Keeps page faults out of part 1: glibc trims the top of its heap once
    128 KiB are free there, so each run of a chain of 64 KiB tensors would
    fault its memory in again (most of plain autograd's time, and a
    variant that frees its saved tensors early would skip it). With trimming
    off and the mmap threshold fixed at 32 MiB (which also ends glibc's
    dynamic threshold), blocks up to 32 MiB are reused, already faulted in,
    and larger ones (part 2's 64 MiB) are fresh mmaps every time. Returns
    whether glibc accepted both settings."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) and
                    libc.mallopt(M_MMAP_THRESHOLD, 32 * MIB))
    except (OSError, AttributeError):
        return False


def median(values):
    return statistics.median(values) if values else float("nan")


# -- part 1: per saved tensor -----------------------------------------------------------

def make_variants(torch, stash_views, stash_copy):
    """name -> (context factory, stash or None)."""
    hooks = torch.autograd.graph.saved_tensors_hooks
    return {
        "plain": (contextlib.nullcontext, None),
        "identity": (lambda: hooks(lambda t: t, lambda t: t), None),
        "clone": (lambda: hooks(lambda t: t.clone(), lambda t: t), None),
        "actstash": (lambda: stash_views.offload(min_bytes=0), stash_views),
        "actstash-copy": (lambda: stash_copy.offload(min_bytes=0), stash_copy),
    }


def chain_run(torch, x, grad, n, ctx, stash):
    """One timed run: forward of n relus inside ctx, [synchronize], backward,
    graph freed, [synchronize]. Returns (forward s, backward s)."""
    x.grad = None
    t0 = time.perf_counter()
    with ctx():
        y = x
        for _ in range(n):
            y = torch.relu(y)
    if stash is not None:
        stash.synchronize()
    t1 = time.perf_counter()
    torch.autograd.backward(y, grad)
    del y  # the graph (and the saved tensors it still held) goes now
    if stash is not None:
        stash.synchronize()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def count_saved(torch, x, n):
    """How many tensors one forward of the chain saves (a counting pack hook)."""
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = x
        for _ in range(n):
            y = torch.relu(y)
    del y
    return count[0]


def expected_counts(name, n, nbytes):
    out = {"tensors_offloaded": n, "bytes_offloaded": n * nbytes, "tensors_fetched": n,
           "bytes_fetched": n * nbytes, "tensors_kept": 0, "unpacked_from_source": 0,
           "store_failures": 0}
    # With cpu_views, tensors from the engine's view_min_bytes up are read in place;
    # smaller ones are copied back on the unpacking thread.
    from actstash._native import lib as _lib
    view_min = _lib.ENGINE_DEFAULTS["view_min_bytes"]
    out["views"] = n if name == "actstash" and nbytes >= view_min else 0
    return out


AFTER_RUN = {"live_tensors": 0, "live_bytes": 0, "in_flight": 0}


def bench_per_tensor(torch, args, variants, checks):
    results = []
    for nbytes in args.sizes:
        numel = nbytes // 4
        torch.manual_seed(0)
        x = torch.randn(numel, requires_grad=True)
        grad = torch.ones(numel)
        n = args.tensors
        saved = count_saved(torch, x, n)
        checks.expect(f"{fmt_size(nbytes)}: tensors saved by {n} relus (counting hook)", saved, n)
        names = list(variants)
        # Warm-up: one untimed run of each variant (leases, allocator, caches);
        # its gradient must be plain autograd's, bit for bit.
        warm_grads = {}
        for name in names:
            ctx, stash = variants[name]
            chain_run(torch, x, grad, n, ctx, stash)
            warm_grads[name] = x.grad.clone()
        for name in names:
            checks.expect(f"{fmt_size(nbytes)} {name}: gradient bitwise equal to plain",
                          torch.equal(warm_grads[name], warm_grads["plain"]), True)
        del warm_grads
        samples = {name: [] for name in names}  # per repetition: (fwd, bwd)
        engine = {name: dict.fromkeys(ENGINE_DELTAS, 0) for name in names}
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                ctx, stash = variants[name]
                gc.collect()
                before = stash.stats() if stash is not None else None
                fwd, bwd = chain_run(torch, x, grad, n, ctx, stash)
                samples[name].append((fwd, bwd))
                if stash is not None:
                    after = stash.stats()
                    label = f"{fmt_size(nbytes)} {name} rep {rep}"
                    checks.delta(label, before, after, expected_counts(name, n, nbytes))
                    checks.absolute(label, after, AFTER_RUN)
                    for key in ENGINE_DELTAS:
                        engine[name][key] += after[key] - before[key]
        results.append(summarize_per_tensor(nbytes, n, names, samples, engine))
    return results


# Engine counters summed over the timed runs of a variant (reported per tensor).
ENGINE_DELTAS = ("wait_ns", "prefetch_issued", "prefetch_hits", "inline_stores")


def summarize_per_tensor(nbytes, n, names, samples, engine):
    total = {name: [f + b for f, b in samples[name]] for name in names}
    plain = total["plain"]
    extra = {name: [(t - p) / n for t, p in zip(total[name], plain)] for name in names}
    rows = []
    for name in names:
        row = {
            "variant": name,
            "us_per_tensor": median(total[name]) / n * 1e6,
            "forward_us_per_tensor": median([f for f, _ in samples[name]]) / n * 1e6,
            "backward_us_per_tensor": median([b for _, b in samples[name]]) / n * 1e6,
            "extra_us_per_tensor": median(extra[name]) * 1e6,
            "x_plain": median([t / p for t, p in zip(total[name], plain)]),
            "samples_s": [round(t, 6) for t in total[name]],
        }
        if name.startswith("actstash"):
            runs = len(samples[name]) * n
            row["wait_us_per_tensor"] = engine[name]["wait_ns"] / runs / 1e3
            row["prefetch_hits_per_tensor"] = engine[name]["prefetch_hits"] / runs
            row["inline_stores_per_tensor"] = engine[name]["inline_stores"] / runs
        for ref in ("identity", "clone"):
            pairs = [(e, r) for e, r in zip(extra[name], extra[ref]) if r > 0]
            row[f"extra_x_{ref}"] = (median([e / r for e, r in pairs])
                                     if name not in ("plain", ref) and pairs else None)
        rows.append(row)
    return {"bytes": nbytes, "tensors": n, "reps": len(plain), "variants": rows}


# -- part 2: one large activation ------------------------------------------------------

def big_run(torch, x, grad, ctx, stash):
    x.grad = None
    t0 = time.perf_counter()
    with ctx():
        y = torch.relu(x)
    if stash is not None:
        stash.synchronize()
    t1 = time.perf_counter()
    torch.autograd.backward(y, grad)
    del y
    if stash is not None:
        stash.synchronize()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def baseline_runs(torch, src, staging, dst):
    """Times of the three copy baselines on src's bytes (seconds)."""
    t0 = time.perf_counter()
    staging.copy_(src)
    t1 = time.perf_counter()
    one = t1 - t0

    t0 = time.perf_counter()
    staging.copy_(src)
    fresh = torch.empty_like(src)
    fresh.copy_(staging)
    t1 = time.perf_counter()
    out_fresh = t1 - t0
    del fresh

    t0 = time.perf_counter()
    staging.copy_(src)
    dst.copy_(staging)
    t1 = time.perf_counter()
    two = t1 - t0
    return {"one pre-faulted copy": one, "copy out + copy into fresh": out_fresh,
            "two pre-faulted copies": two}


def bench_big(torch, args, variants, checks):
    nbytes = args.big_size
    numel = nbytes // 4
    torch.manual_seed(0)
    x = torch.randn(numel, requires_grad=True)
    grad = torch.ones(numel)
    src = torch.relu(x.detach())            # the bytes the baselines move
    staging = torch.zeros(numel)            # pre-touched
    dst = torch.zeros(numel)                # pre-touched
    names = ["plain", "clone", "actstash", "actstash-copy"]
    warm_grads = {}
    for name in names:  # warm-up; gradients checked against plain autograd's
        ctx, stash = variants[name]
        big_run(torch, x, grad, ctx, stash)
        warm_grads[name] = x.grad.clone()
    for name in names:
        checks.expect(f"{fmt_size(nbytes)} {name}: gradient bitwise equal to plain",
                      torch.equal(warm_grads[name], warm_grads["plain"]), True)
    del warm_grads
    baseline_runs(torch, src, staging, dst)
    samples = {name: [] for name in names}
    base = {}
    for rep in range(args.big_reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            ctx, stash = variants[name]
            gc.collect()
            before = stash.stats() if stash is not None else None
            samples[name].append(big_run(torch, x, grad, ctx, stash))
            if stash is not None:
                after = stash.stats()
                label = f"{fmt_size(nbytes)} {name} rep {rep}"
                checks.delta(label, before, after, expected_counts(name, 1, nbytes))
                checks.absolute(label, after, AFTER_RUN)
        for key, t in baseline_runs(torch, src, staging, dst).items():
            base.setdefault(key, []).append(t)
    del x, grad, src, staging, dst
    gc.collect()

    total = {name: [f + b for f, b in samples[name]] for name in names}
    rows = []
    for name in names:
        extra = [t - p for t, p in zip(total[name], total["plain"])]
        store = [s[0] - p[0] for s, p in zip(samples[name], samples["plain"])]
        fetch = [s[1] - p[1] for s, p in zip(samples[name], samples["plain"])]
        row = {
            "variant": name,
            "ms": median(total[name]) * 1e3,
            "forward_ms": median([f for f, _ in samples[name]]) * 1e3,
            "backward_ms": median([b for _, b in samples[name]]) * 1e3,
            "extra_ms": median(extra) * 1e3 if name != "plain" else 0.0,
            "store_extra_ms": median(store) * 1e3 if name != "plain" else 0.0,
            "fetch_extra_ms": median(fetch) * 1e3 if name != "plain" else 0.0,
            "x_plain": median([t / p for t, p in zip(total[name], total["plain"])]),
            "samples_s": [round(t, 6) for t in total[name]],
        }
        if name != "plain":
            # None when the hooks cost nothing measurable (extra <= 0: noise).
            row["gb_s"] = nbytes / median(extra) / 1e9 if median(extra) > 0 else None
            row["x_baseline"] = {
                key: median([b / e for b, e in zip(times, extra) if e > 0])
                for key, times in base.items()}
        rows.append(row)
    baselines = [{"baseline": key, "ms": median(times) * 1e3,
                  "gb_s": nbytes / median(times) / 1e9} for key, times in base.items()]
    return {"bytes": nbytes, "reps": args.big_reps, "variants": rows, "baselines": baselines}


# -- output ----------------------------------------------------------------------------

def fmt_ratio(v):
    return "-" if v is None else f"{v:.2f}"


def print_report(result):
    cfg = result["config"]
    print(f"hook_bench: torch {cfg['torch']}, {cfg['threads']} torch thread(s), "
          f"{cfg['reps']} repetitions of {cfg['tensors']} saved tensors (median), "
          f"daemon {cfg['daemon']}, malloc {cfg['malloc']}")
    print("Part 1: cost per saved tensor of a relu chain (forward + backward; actstash: "
          "+ synchronize after each)")
    print(f"{'size':>8} {'variant':<14}{'us/tensor':>10}{'fwd us':>8}{'bwd us':>8}"
          f"{'extra us':>10}{'x plain':>9}{'extra x identity':>18}{'extra x clone':>15}"
          f"{'wait us':>9}{'prefetch':>10}")
    for block in result["per_tensor"]:
        for r in block["variants"]:
            extra = "-" if r["variant"] == "plain" else f"{r['extra_us_per_tensor']:.2f}"
            print(f"{fmt_size(block['bytes']):>8} {r['variant']:<14}"
                  f"{r['us_per_tensor']:>10.2f}{r['forward_us_per_tensor']:>8.2f}"
                  f"{r['backward_us_per_tensor']:>8.2f}{extra:>10}{r['x_plain']:>9.2f}"
                  f"{fmt_ratio(r['extra_x_identity']):>18}{fmt_ratio(r['extra_x_clone']):>15}"
                  + (f"{r['wait_us_per_tensor']:>9.2f}{r['prefetch_hits_per_tensor']:>10.2f}"
                     if "wait_us_per_tensor" in r else ""))
    big = result.get("big")
    if big:
        print()
        print(f"Part 2: one {fmt_size(big['bytes'])} activation stored in forward and fetched "
              f"in backward ({big['reps']} repetitions, median)")
        print(f"{'variant':<15}{'run ms':>9}{'extra ms':>10}{'store ms':>10}{'fetch ms':>10}"
              f"{'GB/s':>8}   x baseline (GB/s ratio)")
        for r in big["variants"]:
            if r["variant"] == "plain":
                print(f"{'plain':<15}{r['ms']:>9.2f}{'-':>10}{'-':>10}{'-':>10}{'-':>8}")
                continue
            ratios = ", ".join(f"{k}: {v:.2f}" for k, v in r["x_baseline"].items())
            print(f"{r['variant']:<15}{r['ms']:>9.2f}{r['extra_ms']:>10.2f}"
                  f"{r['store_extra_ms']:>10.2f}{r['fetch_extra_ms']:>10.2f}"
                  f"{'-' if r['gb_s'] is None else format(r['gb_s'], '.2f'):>8}"
                  f"   {ratios}")
        print("baselines (same process, same repetitions):")
        for b in big["baselines"]:
            print(f"  {b['baseline']:<28}{b['ms']:>9.2f} ms{b['gb_s']:>8.2f} GB/s")
        print("extra = run time - plain run time (same repetition); store/fetch: the "
              "forward / backward part of it; GB/s = bytes / extra")
    print()
    print_checks(result["checks"], "counter checks")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4KiB,64KiB",
                        help="saved tensor sizes of part 1, comma-separated (default 4KiB,64KiB)")
    parser.add_argument("--tensors", type=int, default=2000,
                        help="saved tensors per repetition (default 2000)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions (default 7, >= 5)")
    parser.add_argument("--big-size", default="64MiB",
                        help="the large activation of part 2 (default 64MiB; 0 skips it)")
    parser.add_argument("--big-reps", type=int, default=None,
                        help="repetitions of part 2 (default: --reps)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--address", default="",
                        help="socket of a running actstashd (default: start a private one)")
    parser.add_argument("--actstashd", default=None, help="actstashd binary of a private daemon")
    parser.add_argument("--pool-size", default="2GiB", help="pool of a private daemon")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 200 tensors, 3 repetitions")
    parser.add_argument("--malloc", choices=["tuned", "default"], default="tuned",
                        help="tuned (default): glibc heap trimming off, mmap threshold 32 MiB "
                        "(see tune_malloc); default: leave glibc as it is")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    if args.quick:
        args.tensors, args.reps = 200, 3
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.big_size = parse_size(args.big_size)
    args.big_reps = args.big_reps or args.reps
    for size in args.sizes + ([args.big_size] if args.big_size else []):
        if size <= 0 or size % 4:
            parser.error(f"sizes must be positive multiples of 4 bytes (fp32): {size}")
    if args.tensors < 1 or args.reps < 1:
        parser.error("--tensors and --reps must be >= 1")

    malloc = "default"
    if args.malloc == "tuned":
        malloc = "tuned" if tune_malloc() else "default (mallopt failed)"
    import torch
    actstash = import_actstash()
    torch.set_num_threads(args.threads)
    checks = Checks()
    with daemon_address(args) as (address, daemon):
        stash_views = actstash.connect(address, cpu_views=True, name="hook_bench-views")
        stash_copy = actstash.connect(address, cpu_views=False, name="hook_bench-copy")
        variants = make_variants(torch, stash_views, stash_copy)
        result = {"config": {
            "torch": torch.__version__, "threads": args.threads, "reps": args.reps,
            "tensors": args.tensors, "sizes": args.sizes, "big_size": args.big_size,
            "big_reps": args.big_reps, "quick": args.quick,
            "daemon": address if args.address else f"private ({args.pool_size} pool)",
            "attached": stash_views.stats().get("attached"), "malloc": malloc,
        }}
        result["per_tensor"] = bench_per_tensor(torch, args, variants, checks)
        if args.big_size:
            result["big"] = bench_big(torch, args, variants, checks)
        for label, stash in (("actstash", stash_views), ("actstash-copy", stash_copy)):
            result[f"stats_{label}"] = scalar_stats(stash)
            stash.close()
        return finish(result, checks, daemon, args, print_report)  # the daemon's log is still there


if __name__ == "__main__":
    sys.exit(main())
