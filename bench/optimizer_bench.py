"""The CPU AdamW step over N fp32 parameters (split into tensors of a model's
sizes), in parameters per second, all in one run: torch.optim.AdamW
(foreach=False, foreach=True, and fused where this torch has it), actstash's
OffloadAdamW with its states in the daemon's pool (mode="exact", which runs
torch's single-tensor kernels on them, and mode="fast", actstash's C++ step),
and DeepSpeed's DeepSpeedCPUAdam when it can be imported and built here.

Also two memory baselines: the step reads 16 bytes per parameter
(parameter, gradient, two moments) and writes 12 back in place; a plain copy
of a buffer as large as the parameters (GB/s of bytes read + written; a
copy's writes also fetch their lines first, which this does not count) and
an in-place a += b over the same size (read 8, write 4 bytes per element:
the AdamW step's access pattern) give the machine's memory bandwidth, and
each variant's GB/s is set beside the second. Medians of --repeats
steps after a warm-up step; ratios against torch's foreach AdamW and
DeepSpeed's, measured in the same run.

With --dtype bf16 the parameters and gradients are bf16 and every variant
keeps fp32 master weights: torch's AdamW runs on fp32 copies stepped with the
gradients cast to fp32, then rounded into the parameters (what a mixed-
precision trainer does by hand, and what OffloadAdamW does with its masters in
the pool); DeepSpeedCPUAdam is not measured there.

Two more OffloadAdamW rows: "fast (parked)" parks its states between steps
(spill=True on a daemon without a spill tier: the cost of locating and parking
them a piece at a time, nothing spilled), and "fast (half on disk)" runs on a
second daemon with a spill tier (--spill-dir under the temporary directory) and
a pool of half the states: every step reads spilled states back and spills
others (the tier writes and reads its files with O_DIRECT: the disk's speed;
what it moved per step is printed).

Last, the trainer's own memory: RssAnon (/proc/self/statm: resident minus
shared) of a child process holding the parameters and gradients after one
step of torch's AdamW, and of one with OffloadAdamW (its states are the
daemon's shared pool memory, not the trainer's anonymous memory); both with
glibc's mmap threshold at 128 KiB, so that freed temporaries are not counted.

    python3 bench/optimizer_bench.py [--params 100M] [--tensor 4M] [--threads N]
                                     [--dtype fp32|bf16] [--skip WORDS] [--no-spill]
                                     [--no-rss]

torch's and DeepSpeed's variants run first, the daemons start after them: at
1B parameters (--params 1B --tensor 16M --no-spill --no-rss --skip
'foreach=False,exact' on a 24 GiB machine) one variant's memory fits at a time.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "testing", "python"))
from actstash_testing.daemon import DaemonProcess  # noqa: E402
from actstash_testing.paths import BUILD_PYTHON, BUILT_DAEMON  # noqa: E402

if os.environ.get("ACTSTASH_TEST_INSTALLED") != "1":
    sys.path.insert(0, BUILD_PYTHON)
import torch  # noqa: E402

import actstash  # noqa: E402
from actstash.optim import OffloadAdamW  # noqa: E402


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_count(text):
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale \
        else int(text)


def make_params(total, per_tensor, seed, dtype=torch.float32):
    torch.manual_seed(seed)
    sizes = [per_tensor] * (total // per_tensor) + ([total % per_tensor] if total % per_tensor
                                                    else [])
    params = [torch.nn.Parameter((torch.randn(n) * 0.02).to(dtype)) for n in sizes]
    for p in params:
        p.grad = (torch.randn(p.numel()) * 1e-3).to(dtype)
    return params


class MasterWeights:
    """torch's AdamW on fp32 copies of low-precision parameters: the gradients cast to
    fp32 before the step, the masters rounded into the parameters after it."""

    def __init__(self, params, **kwargs):
        self.params = params
        self.masters = [p.detach().float() for p in params]
        self.opt = torch.optim.AdamW(self.masters, **kwargs)

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            m.grad = None
            p.copy_(m)


def median_seconds(fn, repeats):
    """Median time of `repeats` calls of fn, after one call that is not timed."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_steps(opt, repeats):
    # The untimed first step touches the states' pages first.
    return median_seconds(opt.step, repeats)


def memcpy_gbps(nbytes, repeats):
    src = torch.empty(nbytes // 4).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), repeats) / 1e9


def inplace_add_gbps(nbytes, repeats):
    a = torch.empty(nbytes // 4).fill_(1.0)
    b = torch.empty_like(a).fill_(1e-9)
    return 3 * nbytes / median_seconds(lambda: a.add_(b), repeats) / 1e9


def deepspeed_adam():
    """DeepSpeedCPUAdam's class, or the reason it cannot run here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        probe = torch.nn.Parameter(torch.zeros(8))
        probe.grad = torch.zeros(8)
        DeepSpeedCPUAdam([probe], adamw_mode=True).step()  # builds its C++ op (JIT)
        return DeepSpeedCPUAdam, None
    except Exception as error:  # not installed, or its op does not build here
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def rss_child(socket, total, per_tensor, offload, dtype):
    """In a child: one AdamW step, then prints RssAnon in bytes."""
    from actstash_testing.memory import rss_anon
    params = make_params(total, per_tensor, 0, dtype)
    if offload:
        stash = actstash.connect(socket, quota=14 * total + (256 << 20))
        opt = OffloadAdamW(params, stash=stash)
    elif dtype == torch.float32:
        opt = torch.optim.AdamW(params, foreach=False)
    else:
        opt = MasterWeights(params, foreach=False)
    opt.step()
    print(rss_anon())


def rss_of(socket, total, per_tensor, offload, dtype_name):
    from actstash_testing.memory import MMAP_THRESHOLD_ENV
    # Freed temporaries go back to the system: RssAnon is what the trainer holds.
    child = subprocess.run([sys.executable, __file__, "--rss-child", socket, str(total),
                            str(per_tensor), str(int(offload)), dtype_name],
                           capture_output=True, text=True,
                           env=dict(os.environ, **MMAP_THRESHOLD_ENV))
    if child.returncode != 0:
        raise SystemExit("the RssAnon child failed: " + child.stderr[-2000:])
    return int(child.stdout.strip().splitlines()[-1])


def main():
    if sys.argv[1:2] == ["--rss-child"]:
        socket, total, per_tensor, offload, dtype_name = sys.argv[2:7]
        return rss_child(socket, int(total), int(per_tensor), offload == "1",
                         DTYPES[dtype_name])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="100M")
    parser.add_argument("--tensor", default="4M", help="elements per parameter tensor")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="the parameters' and gradients' dtype (bf16: fp32 master weights)")
    parser.add_argument("--skip", default="",
                        help="comma-separated words: variants whose name holds one are left "
                             "out (e.g. 'foreach=False,exact' where memory is short)")
    parser.add_argument("--no-spill", action="store_true",
                        help="skip the half-on-disk row (its daemon's files hold half the "
                             "states)")
    parser.add_argument("--no-rss", action="store_true",
                        help="skip the RssAnon children (they hold the parameters again)")
    args = parser.parse_args()
    total, per_tensor = parse_count(args.params), parse_count(args.tensor)
    torch.set_num_threads(args.threads)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    dtype = DTYPES[args.dtype]
    masters = dtype != torch.float32
    state_bytes = (12 if masters else 8) * total
    # Buffers are placed in whole segments: room for what packing leaves unused.
    room = int(1.1 * state_bytes) + (256 << 20)
    binary = os.environ.get("ACTSTASH_DAEMON_BINARY", BUILT_DAEMON)
    # The daemons start when the first variant that needs one runs, after torch's and
    # DeepSpeed's: a pool's memory is not held beside their states (1B parameters fit
    # this machine one variant at a time, not two).
    daemons, stashes = {}, {}

    def pool(kind="pool"):
        if kind not in stashes:
            if kind == "pool":  # the bench's own states and the RssAnon child's
                daemons[kind] = DaemonProcess(
                    binary, str((1 if args.no_rss else 2) * room + (256 << 20)),
                    segment="64MiB", prefix="actstash-optim-bench-")
                stashes[kind] = actstash.connect(daemons[kind].socket, quota=room)
            else:  # half the states, and a spill tier
                daemons["spill_dir"] = tempfile.mkdtemp(prefix="actstash-optim-bench-spill-")
                daemons[kind] = DaemonProcess(
                    binary, str(max(state_bytes // 2, 64 << 20)), segment="8MiB",
                    extra=("--spill-dir", daemons["spill_dir"]),
                    prefix="actstash-optim-bench-spill-")
                stashes[kind] = actstash.connect(daemons[kind].socket)
        return stashes[kind]

    rows = []
    spill_stats = None
    try:
        torch_adamw = MasterWeights if masters else torch.optim.AdamW
        variants = [
            ("torch foreach=False", lambda ps: torch_adamw(ps, foreach=False, **hyper)),
            ("torch foreach=True", lambda ps: torch_adamw(ps, foreach=True, **hyper))]
        try:
            torch.optim.AdamW(make_params(8, 8, 0), fused=True).step()
            variants.append(
                ("torch fused", lambda ps: torch_adamw(ps, fused=True, **hyper)))
        except Exception as error:  # torch < 2.4 has no CPU fused AdamW
            print(f"torch fused: not in torch {torch.__version__} ({str(error)[:80]})")
        ds_class, ds_why = (None, "not with master weights here") if masters else deepspeed_adam()
        if ds_class is not None:
            variants.append(("DeepSpeedCPUAdam", lambda ps: ds_class(ps, adamw_mode=True,
                                                                     **hyper)))
        else:
            print(f"DeepSpeedCPUAdam: not measured ({ds_why})")
        fast = dict(mode="fast", threads=args.threads, **hyper)
        variants += [("actstash exact (pool)",
                      lambda ps: OffloadAdamW(ps, stash=pool(), mode="exact", **hyper)),
                     ("actstash fast (pool)", lambda ps: OffloadAdamW(ps, stash=pool(), **fast)),
                     ("actstash fast (parked)",
                      lambda ps: OffloadAdamW(ps, stash=pool(), spill=True, **fast))]
        if not args.no_spill:
            variants.append(("actstash fast (half on disk)",
                             lambda ps: OffloadAdamW(ps, stash=pool("spill"), **fast)))
        skip = [word for word in args.skip.split(",") if word]
        for name, make in variants:
            if any(word in name for word in skip):
                print(f"{name}: skipped (--skip)")
                continue
            params = make_params(total, per_tensor, 0, dtype)
            opt = make(params)
            seconds = time_steps(opt, args.repeats)
            rows.append((name, seconds))
            if "on disk" in name:
                spill_stats = stashes["spill"].stats()
            del opt, params
        gbps = memcpy_gbps(4 * total, args.repeats)
        inplace = inplace_add_gbps(4 * total, args.repeats)
        if not args.no_rss:
            pool()
            socket = daemons["pool"].socket
            rss_plain = rss_of(socket, total, per_tensor, False, args.dtype)
            rss_offload = rss_of(socket, total, per_tensor, True, args.dtype)
    finally:
        for stash in stashes.values():
            stash.close()
        for kind in ("pool", "spill"):
            if kind in daemons:
                daemons[kind].stop()
        if "spill_dir" in daemons:
            shutil.rmtree(daemons["spill_dir"], ignore_errors=True)
    by_name = dict(rows)
    base = by_name.get("torch foreach=True")
    ds = by_name.get("DeepSpeedCPUAdam")
    print(f"AdamW step over {total:,} {args.dtype} parameters in tensors of {per_tensor:,}"
          f"{' (fp32 master weights)' if masters else ''}, {args.threads} threads, "
          f"torch {torch.__version__}; medians of {args.repeats}")
    print(f"memcpy of {4 * total / 2**20:.0f} MiB: {gbps:.1f} GB/s (read + written); "
          f"in-place a += b: {inplace:.1f} GB/s")
    print(f"{'variant':30}{'ms/step':>10}{'Mparams/s':>11}{'GB/s':>8}{'/a+=b':>9}"
          f"{'vs foreach':>12}{'vs DeepSpeed':>14}")
    for name, seconds in rows:
        # fp32: read p, g, m, v (16 bytes), write p, m, v (12); with masters: read the
        # master, g (2), m, v, write the master, m, v and p (2): 28 too, the cast
        # gradient's temporary not counted.
        moved = 28 * total / seconds / 1e9
        vs_ds = f"{ds / seconds:>14.2f}" if ds else f"{'-':>14}"
        vs_base = f"{base / seconds:>12.2f}" if base else f"{'-':>12}"
        print(f"{name:30}{1e3 * seconds:>10.1f}{total / seconds / 1e6:>11.1f}{moved:>8.1f}"
              f"{moved / inplace:>9.2f}{vs_base}{vs_ds}")
    if spill_stats is not None:
        steps = args.repeats + 1
        print(f"half on disk: {spill_stats['bytes_spilled'] / steps / 2**20:,.0f} MiB spilled and "
              f"{spill_stats['bytes_restored'] / steps / 2**20:,.0f} MiB read back per step "
              f"(of {state_bytes / 2**20:,.0f} MiB of states)")
    if args.no_rss:
        return
    print(f"trainer RssAnon after one step: torch AdamW {rss_plain / 2**20:,.0f} MiB, "
          f"OffloadAdamW {rss_offload / 2**20:,.0f} MiB (states {state_bytes / 2**20:,.0f} MiB "
          f"in the pool{', masters included' if masters else ''}): "
          f"{(rss_plain - rss_offload) / 2**20:,.0f} MiB less")


if __name__ == "__main__":
    main()
