"""A training step with its optimizer on a CUDA device, every variant in one run:
torch's AdamW with its states on the device (fused, the fastest torch has;
foreach=False, the one OffloadAdamW's default mode is bitwise equal to), and
actstash's OffloadAdamW on the same parameters (the device path: states, and
host copies of parameters and gradients, in the daemon's pool; gradients copied
during backward, the step on the host, parameters back before the next
forward), in its exact and fast modes.

Model: examples/gpt.py's GPT, fp32 parameters under bf16 autocast (--dtype
fp32), or bf16 parameters with fp32 master weights (--dtype bf16: torch's
AdamW then runs on the bf16 parameters themselves, the usual shortcut, and is
another computation). Per variant: the median step time (forward, backward,
clip_grad_norm_, optimizer step) over --steps after --warmup, its ratio to
torch's fused step; the device memory the optimizer holds
(torch.cuda.memory_allocated after the first step minus before it: torch's
states; ~0 for OffloadAdamW); the pool bytes (stats()["optimizer_state_bytes"]);
and the loss after the last step.

    python3 bench/gpu_optimizer_bench.py [--layers 8 --dim 1024 --heads 16 --seq 1024
                                          --batch 8 --dtype fp32 --steps 5] [--csv PATH]
    python3 bench/gpu_optimizer_bench.py --cpu-dry-run  # the code, no GPU: a tiny model
                                                        # on the simulated device

Without a CUDA device it prints "no CUDA device: skipped" and exits 77. Starts
its own actstashd (the build tree's, or $ACTSTASH_DAEMON_BINARY).
"""
import argparse
import csv
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "testing", "python"))
from actstash_testing.paths import EXAMPLES  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, EXAMPLES)
from hook_bench import import_actstash, start_daemon  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--csv", default="")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="every variant on the CPU with a tiny model, the device path on "
                             "the simulated device: checks the benchmark's code without a GPU")
    args = parser.parse_args()
    if args.cpu_dry_run:
        args.layers, args.dim, args.heads, args.seq, args.batch, args.vocab = 2, 64, 2, 32, 2, 128
        args.steps, args.warmup = 2, 1

    import torch
    actstash = import_actstash()
    from actstash._native import lib as _lib
    from actstash.optim import OffloadAdamW
    if not args.cpu_dry_run and not (torch.cuda.is_available() and _lib.cuda_available()):
        print("no CUDA device: skipped (torch: %s, actstash: %s)"
              % (torch.cuda.is_available(), _lib.cuda_available()))
        return 77
    from gpt import GPT, loss_fn
    cuda = not args.cpu_dry_run
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    def allocated():
        return torch.cuda.memory_allocated() if cuda else 0

    def model():
        torch.manual_seed(0)
        return GPT(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers,
                   context=args.seq, dropout=0.0).to(device, dtype)

    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                             generator=torch.Generator().manual_seed(k)).to(device)
               for k in range(args.warmup + args.steps)]
    params = sum(p.numel() for p in model().parameters())
    daemon = start_daemon(pool="%dMiB" % max(64, (params * 24 >> 20) + 64))
    stash = actstash.connect(daemon.socket)
    rows = []

    def run(name, make_opt):
        m = model()
        before = allocated()
        copies = None
        if not cuda and name.startswith("actstash"):
            from actstash_testing.sim_device import SimulatedCopies
            copies = SimulatedCopies(delay_s=0.0)
        opt = make_opt(m, copies)
        times, held, loss = [], 0, None
        for k, idx in enumerate(batches):
            synchronize()
            start = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.float32):
                loss = loss_fn(m, idx)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize()
            if k >= args.warmup:
                times.append(time.perf_counter() - start)
            if k == 0:  # the gradients are gone (set_to_none): what stays is the states
                held = allocated() - before
        pool = stash.stats()["optimizer_state_bytes"]
        rows.append({"variant": name, "step_ms": 1e3 * statistics.median(times),
                     "device_state_mib": held / 2**20, "pool_mib": pool / 2**20,
                     "loss": float(loss.detach())})
        if copies is not None:
            copies.close()
        if hasattr(opt, "close"):
            opt.close()
        del opt, m
        synchronize()

    kw = dict(lr=1e-4, weight_decay=0.1)
    fused = {"fused": True} if cuda else {"foreach": True}
    try:
        run("torch AdamW fused" if cuda else "torch AdamW foreach",
            lambda m, c: torch.optim.AdamW(m.parameters(), **kw, **fused))
        run("torch AdamW foreach=False",
            lambda m, c: torch.optim.AdamW(m.parameters(), **kw, foreach=False))
        run("actstash OffloadAdamW exact",
            lambda m, c: OffloadAdamW(m.parameters(), stash=stash, **kw, _copies=c))
        run("actstash OffloadAdamW fast",
            lambda m, c: OffloadAdamW(m.parameters(), stash=stash, **kw, mode="fast", _copies=c))
    finally:
        stash.close()
        daemon.stop()

    base = rows[0]["step_ms"]
    print("GPT %d layers, d=%d, seq %d, batch %d, %s parameters (%.0fM), %s"
          % (args.layers, args.dim, args.seq, args.batch, args.dtype, params / 1e6,
             "CUDA" if cuda else "CPU dry run (simulated device)"))
    print("%-30s %9s %7s %12s %9s %8s" % ("variant", "step ms", "×first", "device MiB",
                                          "pool MiB", "loss"))
    for r in rows:
        r["ratio"] = r["step_ms"] / base
        print("%-30s %9.1f %7.2f %12.1f %9.1f %8.4f" % (
            r["variant"], r["step_ms"], r["ratio"], r["device_state_mib"], r["pool_mib"],
            r["loss"]))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
