"""Training step on a CUDA device, every variant in the same run, for two models.

GPT-style model (examples/gpt.py): plain autograd, torch.utils.checkpoint per
block, the peers' selective activation checkpointing per block (torch SAC:
matmul outputs saved, the rest recomputed; torch >= 2.4), torch's save_on_cpu,
actstash offload, actstash checkpoint+offload per block, actstash selective
per block (the same SAC policy, the block input offloaded), and actstash
policy="auto" at budgets 1/4, 1/2 and 3/4 of the way from the smallest peak a
plan reaches to keeping everything: step time against peak memory, on the
device's real link.

Hugging Face Llama made from a config (random weights, eager attention), beside
the offloaders its users already have: plain; transformers' gradient
checkpointing; transformers' checkpointing with its own offload
(gradient_checkpointing_enable(offload=True): save_on_cpu around each layer's
checkpoint, transformers >= 5.17); torchtune's OffloadActivations with
torch.utils.checkpoint per layer (as torchtune recommends; CUDA only); actstash
offload; actstash checkpoint+offload (wrap, the decoder layers); actstash
through transformers' own route (use_for_gradient_checkpointing). A peer whose
package or version is missing, or that needs CUDA on the CPU, is a row that
says "skipped" and why.

Per variant: the median step time over --steps (after --warmup), its ratio to
plain, torch.cuda.max_memory_allocated during the step above what was
allocated before it (the step's activations and transients), the bytes actstash
moved and its unpacks' waits (per step), and whether the first step's
gradients are bitwise equal to plain autograd on the same seed (dropout on in
the GPT, so the RNG replay is checked too).

    python3 bench/gpu_step_bench.py [--layers 12 --dim 2048 --heads 16 --seq 2048
                                     --batch 1 --dtype bf16 --steps 5] [--csv PATH]
                                    [--models gpt,llama]
    python3 bench/gpu_step_bench.py --quick      # a small model: seconds per variant
    python3 bench/gpu_step_bench.py --cpu-dry-run  # the benchmark's own code, no GPU

Without a CUDA device (torch's or actstash's) it prints "no CUDA device: skipped"
and exits 77. Starts its own actstashd (the build tree's, or $ACTSTASH_DAEMON_BINARY).
Exits 1 when an actstash variant is not bitwise equal to plain.
"""
import argparse
import copy
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
from model_bench import checkpoint_layers, sac_context  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--min-bytes", type=int, default=1 << 20)
    parser.add_argument("--pool", default="", help="daemon pool (default: 3x plain's peak)")
    parser.add_argument("--quick", action="store_true", help="6 layers, d=1024, seq 1024")
    parser.add_argument("--csv", default="")
    parser.add_argument("--models", default="gpt,llama",
                        help="comma-separated: gpt (examples/gpt.py), llama (transformers)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run every variant on the CPU with a tiny model (peaks read 0): "
                             "checks the benchmark's own code without a GPU")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.dim, args.heads, args.seq, args.steps = 6, 1024, 8, 1024, 3
    if args.cpu_dry_run:
        args.layers, args.dim, args.heads, args.seq, args.vocab = 3, 64, 2, 32, 128
        args.steps, args.warmup, args.min_bytes, args.dtype = 2, 1, 0, "fp32"

    # Deterministic kernels (cuBLAS workspace, index ops), so that "bitwise" compares
    # actstash with plain autograd rather than run-to-run noise.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    actstash = import_actstash()
    from actstash._native import lib as _lib
    if not args.cpu_dry_run and not (torch.cuda.is_available() and _lib.cuda_available()):
        print("no CUDA device: skipped (torch: %s, actstash: %s)"
              % (torch.cuda.is_available(), _lib.cuda_available()))
        return 77
    from gpt import GPT, Block, loss_fn
    device = "cpu" if args.cpu_dry_run else "cuda"
    cuda = device == "cuda"

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    base = GPT(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers,
               context=args.seq, dropout=0.1).to(device, dtype)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)

    def make_step(loss_of):
        """One timed training step of `model` whose loss is loss_of(model): the
        seconds and the device memory peak above what was allocated before."""
        def step(model, k, context=None):
            model.zero_grad(set_to_none=True)
            synchronize()
            before = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(1000 + k)
            start = time.perf_counter()
            if context is None:
                loss = loss_of(model)
            else:
                with context():
                    loss = loss_of(model)
            loss.backward()
            synchronize()
            seconds = time.perf_counter() - start
            return seconds, (torch.cuda.max_memory_allocated() - before) if cuda else 0
        return step

    run_step = make_step(lambda model: loss_fn(model, idx))

    def grads(model):
        return [p.grad.clone() for p in model.parameters()]

    def torch_checkpointed(model, context_fn=None):
        checkpoint_layers(model.blocks, context_fn)
        return model

    from torch.utils import checkpoint as torch_cp
    has_sac = hasattr(torch_cp, "create_selective_checkpoint_contexts")

    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in ("gpt", "llama"):
            parser.error("--models: gpt, llama")

    # Plain first: its gradients are the reference, its peak sizes the pool.
    plain = copy.deepcopy(base)
    run_step(plain, 0)
    _, plain_peak = run_step(plain, 0)
    del plain
    pool = args.pool or "%dMiB" % max(1024, 3 * plain_peak >> 20)
    daemon = start_daemon(pool=pool)
    stash = actstash.connect(daemon.socket)
    rows = []

    def measure(model_name, name, model, context, reference, step=run_step):
        """One variant: its first step's gradients against `reference` (returned, the
        reference of the variants after plain), then the timed steps."""
        before = stash.stats()
        step(model, 0, context)
        first = grads(model)
        bitwise = reference is None or all(torch.equal(a, b) for a, b in zip(reference, first))
        times, peaks = [], []
        for k in range(args.warmup + args.steps):
            seconds, peak = step(model, k + 1, context)
            if k >= args.warmup:
                times.append(seconds)
                peaks.append(peak)
        after = stash.stats()
        ran = 1 + args.warmup + args.steps  # the moved bytes and waits are per step
        plan = ""
        if name.startswith("actstash auto") and stash.plan() is not None:
            plan = " ".join(stash.plan().choices)
        rows.append({
            "model": model_name, "variant": name, "step_ms": 1e3 * statistics.median(times),
            "peak_mib": max(peaks) / 2**20, "bitwise": bitwise,
            "offloaded_mib": (after["bytes_offloaded"] - before["bytes_offloaded"]) / 2**20 / ran,
            "fetched_mib": (after["bytes_fetched"] - before["bytes_fetched"]) / 2**20 / ran,
            "wait_ms": (after["wait_ns"] - before["wait_ns"]) / 1e6 / ran,
            "plan": plan, "skipped": ""})
        return first

    def skipped(model_name, name, why):
        rows.append({"model": model_name, "variant": name, "step_ms": 0.0, "peak_mib": 0.0,
                     "bitwise": None, "offloaded_mib": 0.0, "fetched_mib": 0.0,
                     "wait_ms": 0.0, "plan": "", "skipped": why})

    try:
        def offload_context():
            return stash.offload(min_bytes=args.min_bytes)

        def save_on_cpu():
            return torch.autograd.graph.save_on_cpu(pin_memory=cuda)

        def auto(fraction):
            """wrap(policy="auto") at `fraction` of the way from the smallest peak a plan
            reaches to keeping every block (both from an unlimited plan's report)."""
            def prepare(model):
                actstash.wrap(model, stash, policy="auto", budget=1 << 50,
                              min_bytes=args.min_bytes)
                run_step(model, 0)
                run_step(model, 0)
                report = stash.plan()
                actstash.unwrap(model)
                budget = int(report.smallest_peak +
                             fraction * (report.kept_peak - report.smallest_peak))
                actstash.wrap(model, stash, policy="auto", budget=budget,
                              min_bytes=args.min_bytes)
                return model
            return prepare

        if "gpt" in models:
            variants = [
                ("plain", lambda m: m, None),
                ("torch.checkpoint", torch_checkpointed, None),
                ("torch SAC", lambda m: torch_checkpointed(m, sac_context), None),
                ("save_on_cpu", lambda m: m, save_on_cpu),
                ("actstash offload", lambda m: m, offload_context),
                ("actstash ckpt+offload",
                 lambda m: actstash.wrap(m, stash, blocks=Block, mode="checkpoint+offload",
                                         min_bytes=args.min_bytes) or m, None),
                ("actstash selective",
                 lambda m: actstash.wrap(m, stash, blocks=Block, mode="selective",
                                         min_bytes=args.min_bytes) or m, None),
                ("actstash auto (1/4)", auto(0.25), None),
                ("actstash auto (middle)", auto(0.5), None),
                ("actstash auto (3/4)", auto(0.75), None),
            ]
            reference = None
            for name, prepare, context in variants:
                if not has_sac and name in ("torch SAC", "actstash selective"):
                    skipped("gpt", name, f"torch {torch.__version__} has no selective "
                            "activation checkpointing (>= 2.4)")
                    continue
                model = prepare(copy.deepcopy(base))
                got = measure("gpt", name, model, context, reference)
                if reference is None:
                    reference = got
                if name.startswith("actstash"):
                    actstash.unwrap(model)
                del model
                if cuda:
                    torch.cuda.empty_cache()
        del base
        if "llama" in models:
            from llama_peers import run_llama_peers
            run_llama_peers(args, torch, actstash, stash, device, dtype, measure, skipped,
                            make_step, offload_context)
    finally:
        stash.close()
        daemon.stop()

    print("%d layers, d=%d, %d heads, seq %d, batch %d, %s, on %s; median of %d steps"
          % (args.layers, args.dim, args.heads, args.seq, args.batch, args.dtype,
             torch.cuda.get_device_name(0) if cuda else "the CPU (dry run)", args.steps))
    for model_name in models:
        mine = [r for r in rows if r["model"] == model_name]
        if not mine:
            continue
        base_ms, base_peak = mine[0]["step_ms"], mine[0]["peak_mib"]
        print("\n%s" % {"gpt": "GPT (examples/gpt.py)",
                        "llama": "Hugging Face Llama (random weights)"}[model_name])
        print("%-26s %9s %6s %10s %6s %8s %11s %9s %7s"
              % ("variant", "step ms", "×plain", "peak MiB", "×plain", "bitwise", "offload MiB",
                 "fetch MiB", "wait ms"))
        for r in mine:
            if r["skipped"]:
                r["time_ratio"] = r["peak_ratio"] = 0.0
                print("%-26s skipped: %s" % (r["variant"], r["skipped"]))
                continue
            r["time_ratio"] = r["step_ms"] / base_ms if base_ms else 0.0
            r["peak_ratio"] = r["peak_mib"] / base_peak if base_peak else 0.0
            print("%-26s %9.1f %6.2f %10.0f %6.2f %8s %11.0f %9.0f %7.1f %s"
                  % (r["variant"], r["step_ms"], r["time_ratio"], r["peak_mib"],
                     r["peak_ratio"], "yes" if r["bitwise"] else "NO", r["offloaded_mib"],
                     r["fetched_mib"], r["wait_ms"], r["plan"]))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            writer.writeheader()
            writer.writerows(rows)
    # Exit 1 when an actstash variant is not bitwise (the peers' are reported only).
    return 0 if all(r["bitwise"] for r in rows
                    if r["variant"].startswith("actstash") and not r["skipped"]) else 1


if __name__ == "__main__":
    sys.exit(main())
