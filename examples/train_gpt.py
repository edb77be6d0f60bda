#!/usr/bin/env python3
"""Trains a small GPT-style model for a few steps in five modes and prints,
side by side: step time (median), activation memory held by the trainer at
the end of forward (CPU: RssAnon growth over the forward; --device cuda: growth
of torch.cuda.memory_allocated), peak RSS (CUDA: peak allocated), bytes
offloaded, and whether the gradients are bitwise equal to plain autograd.

    ACTSTASH_ADDRESS=/path/to/actstash.sock python3 examples/train_gpt.py
    scripts/demo            # starts a private actstashd and runs this

Each mode runs in its own process (so that peak RSS is its own), with
MALLOC_MMAP_THRESHOLD_=131072 so that freed tensors leave the process and
RssAnon tracks live tensors.
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ["none", "torch-checkpoint", "save_on_cpu", "actstash-offload",
         "actstash-checkpoint+offload"]
# Not run by default: "actstash-offload-bf16" (offload with the lossy bf16 downcast).


def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_shmem():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def run_mode(args):
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpt import GPT, Block, loss_fn
    torch.set_num_threads(args.threads)

    cuda = args.device == "cuda"
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers,
                context=args.context, dropout=0.1).to(args.device)
    data = torch.randint(0, args.vocab, (args.steps + 2, args.batch, args.context + 1))
    data = data.to(args.device)

    def held_now():  # what the trainer holds: host RSS, or allocated GPU memory
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return rss_anon()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stash = None
    ctx = None
    if args.mode == "torch-checkpoint":
        from torch.utils.checkpoint import checkpoint
        for block in model.blocks:
            block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(
                block.forward)
    elif args.mode == "save_on_cpu":
        ctx = lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda)  # noqa: E731
    elif args.mode.startswith("actstash"):
        import actstash
        # "-bf16": the opt-in lossy downcast (half the bytes; gradients not bitwise equal).
        downcast = "bf16" if args.mode.endswith("-bf16") else None
        stash = actstash.connect(args.address or None, copy_delay_us=args.copy_delay_us,
                                 downcast=downcast)
        mode = ("offload" if args.mode.startswith("actstash-offload")
                else "checkpoint+offload")
        actstash.wrap(model, stash, blocks=Block, mode=mode, min_bytes=args.min_bytes)

    times, held = [], []
    first_grads = None
    # Step 0 warms up (leases, allocator); steps 1..N are timed; a last,
    # untimed step measures memory after waiting for the copies in flight
    # (a timed step must not wait: stores overlap the start of backward).
    for step in range(args.steps + 2):
        measure = step == args.steps + 1
        torch.manual_seed(100 + step)
        optimizer.zero_grad(set_to_none=True)
        if measure:  # nothing of the last step may be freed during this forward
            loss = None
            gc.collect()
            if stash is not None:
                stash.synchronize()
        before = held_now()
        start = time.perf_counter()
        if ctx is not None:
            with ctx():
                loss = loss_fn(model, data[step])
        else:
            loss = loss_fn(model, data[step])
        if measure:
            if stash is not None:
                stash.synchronize()  # what the trainer still holds once the copies are done
            held.append(held_now() - before)
        loss.backward()
        if step == 0:
            first_grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()  # the step's kernels and copies are part of its time
        if 0 < step <= args.steps:
            times.append(time.perf_counter() - start)
    result = {
        "mode": args.mode,
        "step_seconds": statistics.median(times),
        "held_bytes": held[0],
        "peak_rss": torch.cuda.max_memory_allocated() if cuda else peak_rss(),
        # Mapped segments of the daemon's pool count in RSS but are not the trainer's memory.
        "shared_rss": rss_shmem(),
        "loss": float(loss),
    }
    if stash is not None:
        stats = stash.stats()
        result["offloaded_bytes_per_step"] = stats["bytes_offloaded"] // (args.steps + 2)
        result["wait_seconds"] = stats["wait_seconds"]
        stash.close()
    torch.save(first_grads, args.grads_out)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=os.environ.get("ACTSTASH_ADDRESS", ""))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the model trains (cuda: needs torch with CUDA, and "
                        "actstash offloads CUDA tensors through its CUDA copy engine)")
    parser.add_argument("--min-bytes", type=int, default=64 << 10)
    parser.add_argument("--copy-delay-us", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=1,
                        help="run all modes this many times, round-robin; report medians")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--grads-out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.mode:  # a child: one mode
        print(json.dumps(run_mode(args)))
        return 0

    import tempfile
    import torch
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    modes = args.modes.split(",")
    rounds = []  # per round, per mode: the child's result
    with tempfile.TemporaryDirectory() as tmp:
        # Modes run round-robin, `--rounds` times: on a shared machine, load
        # changes over minutes; a ratio taken within one round pairs runs
        # made close together.
        for _ in range(args.rounds):
            per_mode = {}
            for mode in modes:
                grads = os.path.join(tmp, mode + ".pt")
                argv = [sys.executable, os.path.abspath(__file__), "--mode", mode,
                        "--grads-out", grads] + [a for a in sys.argv[1:] if a != "--json"]
                out = subprocess.run(argv, env=env, capture_output=True, text=True)
                if out.returncode != 0:
                    print(out.stderr, file=sys.stderr)
                    return 1
                per_mode[mode] = json.loads(out.stdout.strip().splitlines()[-1])
                per_mode[mode]["grads"] = torch.load(grads)
            rounds.append(per_mode)
    results = []
    base_mode = modes[0]
    for mode in modes:
        runs = [r[mode] for r in rounds]
        result = dict(runs[len(runs) // 2])
        result.pop("grads")
        result["step_seconds"] = statistics.median(r["step_seconds"] for r in runs)
        result["held_bytes"] = int(statistics.median(r["held_bytes"] for r in runs))
        result["step_ratio"] = statistics.median(
            r[mode]["step_seconds"] / r[base_mode]["step_seconds"] for r in rounds)
        base_held = statistics.median(r[base_mode]["held_bytes"] for r in rounds)
        result["held_ratio"] = result["held_bytes"] / base_held if base_held else 0.0
        result["grads_equal"] = all(
            all(torch.equal(a, b) for a, b in zip(r[base_mode]["grads"], r[mode]["grads"]))
            for r in rounds)
        result["rounds"] = len(rounds)
        results.append(result)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"GPT {args.layers}x{args.dim}, batch {args.batch}x{args.context}, {args.steps} steps "
          f"(median after 1 warm-up), {args.threads} thread(s), {args.rounds} round(s); "
          f"x none: median of the per-round ratios")
    print(f"{'mode':<29}{'step ms':>9}{'x none':>8}{'held MiB':>10}{'x none':>8}"
          f"{'peak RSS MiB':>14}{'shared MiB':>12}{'grads equal':>13}")
    for r in results:
        print(f"{r['mode']:<29}{r['step_seconds'] * 1e3:>9.1f}{r['step_ratio']:>8.2f}"
              f"{r['held_bytes'] / 2**20:>10.1f}{r['held_ratio']:>8.2f}"
              f"{r['peak_rss'] / 2**20:>14.1f}{r['shared_rss'] / 2**20:>12.1f}"
              f"{str(r['grads_equal']):>13}")
    print("held: RssAnon growth over forward (activations the trainer keeps); peak RSS "
          "includes the shared pool segments mapped for zero-copy (shared column).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
