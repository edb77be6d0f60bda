#!/usr/bin/env python3
"""auto_plan_bench: step time and peak memory of wrap(policy="auto") at several
memory budgets, next to the uniform plans (every block offload, checkpoint,
checkpoint+offload or, with torch >= 2.4, selective, through actstash.wrap),
torch.utils.checkpoint per block, the peers' selective activation checkpointing
per block (torch_sac: matmul and convolution outputs saved), torch.compile of
the whole model at several activation_memory_budget values (compile@B, torch >=
2.4) and plain autograd, measured in one process with the variants interleaved:
the Pareto front of step time against peak memory.

    bench/auto_plan_bench.py                  # both models, a private actstashd
    bench/auto_plan_bench.py --quick          # a smoke run
    bench/auto_plan_bench.py --plot docs/auto_plan.png
    bench/auto_plan_bench.py --link-ratios 0,1,4   # also on a simulated link
    bench/auto_plan_bench.py --json > r.json; bench/auto_plan_bench.py --from-json r.json \
        --plot docs/auto_plan.png   # the plot from any python with matplotlib

--link-ratios: 0 is the CPU as it is; R > 0 connects every stash with
simulate_link_gbps chosen so that storing what offloading every block stores
takes R times plain autograd's step (both measured first, in this run), as a GPU's
PCIe link makes it (on an H200 a 12-layer GPT stored 5.6 GiB per step: about 2.7
times its step each way).

Models: model_bench.py's (the GPT of scripts/demo, 6 blocks of width 256, batch
8 x 128; nn.TransformerEncoder, 4 layers of width 256, batch 2 x 128), fp32, CPU,
one torch thread. A step is zero_grad, forward and backward with no optimizer, so
every variant's step k computes the gradients of the same parameters on batch k
with seed 100 + k: each is compared bitwise with plain autograd's (exit 1 when
an actstash variant differs; the compiled peers are not compared: inductor's
kernels round differently from eager ones). Each compiled variant runs two
untimed steps (compilation) before timing; dynamo's recompile limit is raised
so that every variant compiles its own model.

Auto measures --candidates plans (wrap(candidates=), default 3) for one step
each before it commits; --candidates 1 shows the model's plan alone.

Budgets: two first auto runs with an unlimited budget report the peaks any plan
can reach (predicted: the smallest, and every block kept; the larger of the two
runs' figures); the budgets are the
kept peak x 1.1 (everything fits), 3/4, 1/2 and 1/4 of the way from the smallest
to the kept peak, the smallest x 1.3, and torch_sac's measured peak (the bar
there: auto within 1.05x of SAC). Each budget's model is wrapped once and
warmed up for --warmup steps (profiling, candidates, checks, corrections) before
timing.

Memory: the peak of RssAnon from the first block's forward to the end of
backward, above RssAnon at the first block's forward, sampled by a thread in one
untimed step per variant and round (the planner's budget counts the same
span). glibc is told to hand freed blocks of 128 KiB and more back at once
(MALLOC_MMAP_THRESHOLD_, the script re-executes itself with it) so that RssAnon
follows what the trainer holds; this makes every variant pay page faults.

Time: per round and variant, --steps timed steps (median), variants rotating;
reported as the median over rounds. Ratios pair runs of one round: "x plain"
is the median over rounds of the variant's time over plain's, and auto/best
the median of auto's time over the time of the best uniform plan that fits
(the one of least "x plain" whose measured peak is within the budget; the
peak is the largest over rounds).
"""
import argparse
import copy
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "testing", "python"))
from actstash_testing.memory import PeakMeter, reexec_with_mmap_threshold  # noqa: E402
from actstash_testing.paths import EXAMPLES  # noqa: E402
from actstash_testing.training import bitwise_equal, cloned_grads  # noqa: E402
from hook_bench import daemon_address, import_actstash, median  # noqa: E402
from model_bench import (ModelSpec, checkpoint_layers, encoder_spec, gpt_spec,  # noqa: E402
                         sac_context)

UNIFORM = ["plain", "offload", "checkpoint", "checkpoint+offload", "torch_checkpoint"]
SAC_KINDS = ["selective", "torch_sac"]  # torch >= 2.4
NO_STASH = ("plain", "checkpoint", "torch_checkpoint", "torch_sac")
MIB = 1 << 20


class CudaPeakMeter:
    """PeakMeter's interface on CUDA: the caching allocator's peak during the step
    above what was allocated at the first block's forward (synchronized)."""

    def __init__(self, torch, first_block):
        self.torch, self.armed, self.running, self.baseline, self.peak = torch, False, False, 0, 0
        first_block.register_forward_pre_hook(self._begin)

    def _begin(self, module, args):
        if self.running or not self.armed or not self.torch.is_grad_enabled():
            return
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self.baseline, self.running = self.torch.cuda.memory_allocated(), True

    def stop(self):
        if self.running:
            self.torch.cuda.synchronize()
            self.peak = self.torch.cuda.max_memory_allocated() - self.baseline
            self.running = False
        return self.peak


class Variant:
    def __init__(self, torch, actstash, spec, initial, kind, stash, budget=None,
                 min_bytes=64 << 10, candidates=3):
        self.torch, self.spec, self.kind, self.stash, self.budget = torch, spec, kind, stash, budget
        self.model = copy.deepcopy(initial)
        self.model.train()
        self.run_model = self.model
        blocks = spec.layers(self.model)
        cuda = next(self.model.parameters()).is_cuda
        self.meter = CudaPeakMeter(torch, blocks[0]) if cuda else PeakMeter(blocks[0], armed=False)
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        if kind == "compile":  # budget: activation_memory_budget, a fraction
            self.run_model = torch.compile(self.model)
        elif kind == "auto":
            actstash.wrap(self.model, stash, blocks=spec.layer_class, policy="auto", budget=budget,
                          min_bytes=min_bytes, candidates=candidates)
        elif kind == "torch_checkpoint":
            checkpoint_layers(blocks)
        elif kind == "torch_sac":
            checkpoint_layers(blocks, context_fn=sac_context)
        elif kind != "plain":
            actstash.wrap(self.model, stash if kind != "checkpoint" else None,
                          blocks=spec.layer_class, mode=kind, min_bytes=min_bytes)
        self.step_index, self.times, self.peaks, self.digests = 0, [], [], {}

    @property
    def label(self):
        if self.kind == "compile":
            return f"compile@{self.budget:g}"
        return f"auto@{self.budget / MIB:.1f}MiB" if self.kind == "auto" else self.kind

    def step(self, batches, measure_peak=False):
        torch, k = self.torch, self.step_index
        batch = batches(k)
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + k)
        self.meter.armed = measure_peak
        start = time.perf_counter()
        if self.kind == "compile":
            from torch._functorch import config
            with config.patch(activation_memory_budget=self.budget):
                self.spec.loss(self.run_model, batch).backward()
        else:
            self.spec.loss(self.model, batch).backward()
        self.sync()
        elapsed = time.perf_counter() - start
        if measure_peak:
            self.peaks.append(self.meter.stop())
        self.digests[k] = cloned_grads(self.model)
        self.step_index += 1
        return elapsed


def on_cuda(torch, spec):
    """The same model and batches on the GPU."""
    def move(batch):
        if isinstance(batch, (tuple, list)):
            return type(batch)(move(b) for b in batch)
        return batch.cuda() if isinstance(batch, torch.Tensor) else batch
    return ModelSpec(spec.name, spec.describe + ", CUDA", lambda: spec.build().cuda(),
                     spec.layers, spec.layer_class, lambda k: move(spec.make_batch(k)),
                     spec.loss)


def kinds(torch):
    from torch.utils import checkpoint as torch_cp
    sac = hasattr(torch_cp, "create_selective_checkpoint_contexts")
    return UNIFORM + (SAC_KINDS if sac else [])


def link_gbps(torch, actstash, spec, address, args, ratio):
    """The simulated link's GB/s at which storing what offloading every block stores
    takes `ratio` times plain autograd's step (both measured here, medians of 3)."""
    torch.manual_seed(0)
    initial = spec.build()
    plain = Variant(torch, actstash, spec, initial, "plain", None)
    stash = actstash.connect(address)
    try:
        offload = Variant(torch, actstash, spec, initial, "offload", stash,
                          min_bytes=args.min_bytes)
        offload.step(spec.make_batch)
        before = stash.stats()["bytes_offloaded"]
        offload.step(spec.make_batch)
        stored = stash.stats()["bytes_offloaded"] - before
    finally:
        stash.close()
    plain.step(spec.make_batch)
    step_s = median([plain.step(spec.make_batch) for _ in range(3)])
    return stored / (ratio * step_s) / 1e9, stored, step_s


def bench_model(torch, actstash, spec, address, args, ratio=0.0):
    gbps, stored, step_s = link_gbps(torch, actstash, spec, address, args, ratio) \
        if ratio else (None, None, None)
    torch.manual_seed(0)
    initial = spec.build()
    stashes = []

    def stash():
        s = actstash.connect(address, simulate_link_gbps=gbps)
        stashes.append(s)
        return s

    # Two profiles: one profile's sampled working sets can come out several times
    # too small, and budgets below what a plan reaches only measure refusals.
    reachable = []
    for _ in range(2):
        probe = Variant(torch, actstash, spec, initial, "auto", stash(), budget=1 << 40,
                        min_bytes=args.min_bytes)
        for _ in range(2):
            probe.step(spec.make_batch)
        report = probe.stash.plan()
        reachable.append((report.smallest_peak, report.kept_peak))
    low, high = max(r[0] for r in reachable), max(r[1] for r in reachable)
    budgets = [int(high * 1.1)] + [int(low + f * (high - low)) for f in (0.75, 0.5, 0.25)] + \
        [int(low * 1.3)]
    variants = [Variant(torch, actstash, spec, initial, kind,
                        None if kind in NO_STASH else stash(),
                        min_bytes=args.min_bytes) for kind in kinds(torch)]
    variants += [Variant(torch, actstash, spec, initial, "compile", None, budget=b)
                 for b in args.compile_budgets]
    sac = next((v for v in variants if v.kind == "torch_sac"), None)
    sac_peak = None
    if sac is not None:  # one more budget: SAC's own peak, measured (the bar: <= 1.05x SAC)
        sac.step(spec.make_batch)
        sac.step(spec.make_batch, measure_peak=True)
        sac_peak = sac.peaks[-1]
        budgets = sorted(budgets + [sac_peak], reverse=True)
    errors = {}
    for v in [v for v in variants if v.kind == "compile"]:
        try:  # compiled before timing (and its first steps' recompiles)
            for _ in range(2):
                v.step(spec.make_batch)
        except Exception as error:  # e.g. no C compiler for inductor: the peer is left out
            errors[v.label] = f"{type(error).__name__}: {str(error)[:300]}"
            variants.remove(v)
    autos = [Variant(torch, actstash, spec, initial, "auto", stash(), budget=b,
                     min_bytes=args.min_bytes, candidates=args.candidates) for b in budgets]
    for v in autos:
        try:
            for _ in range(args.warmup):
                v.step(spec.make_batch)
        except actstash.BudgetError as error:
            errors[v.label] = str(error)
    autos = [v for v in autos if v.label not in errors]
    everyone = variants + autos
    for r in range(args.rounds):
        order = everyone[r % len(everyone):] + everyone[:r % len(everyone)]
        for v in order:
            v.step(spec.make_batch, measure_peak=True)
            v.times.append(median([v.step(spec.make_batch) for _ in range(args.steps)]))
    plain = everyone[0]
    mismatches = []
    for v in everyone[1:]:
        if v.kind == "compile":
            continue  # compiled kernels round differently from eager: a peer, not checked
        for k, grads in v.digests.items():
            while plain.step_index <= k:
                plain.step(spec.make_batch)
            if not bitwise_equal(grads, plain.digests[k]):
                mismatches.append(f"{v.label} step {k}")
    rows = {v.label: {"kind": v.kind, "budget": v.budget, "time_s": median(v.times),
                      "round_s": v.times,
                      "x_plain": median([t / p for t, p in zip(v.times, plain.times)]),
                      "peak": max(v.peaks), "choices": v.stash.plan().choices
                      if v.kind == "auto" else None,
                      "predicted_peak": v.stash.plan().predicted_peak if v.kind == "auto"
                      else None,
                      "table": str(v.stash.plan()) if v.kind == "auto" else None}
            for v in everyone}
    for s in stashes:
        s.close()
    return {"model": spec.describe, "name": spec.name, "smallest": low, "kept": high,
            "budgets": budgets, "sac_peak": sac_peak, "rows": rows, "errors": errors,
            "mismatches": mismatches,
            "link_ratio": ratio, "link_gbps": gbps, "calibration": {
                "offload_stored_bytes": stored, "plain_step_s": step_s}}


def compare(result):
    """Per budget: auto next to the fastest uniform plan (or torch checkpoint) that fits."""
    out = []
    uniform = [(label, row) for label, row in result["rows"].items() if row["kind"] != "auto"
               and row["kind"] != "plain"]
    for label, row in result["rows"].items():
        if row["kind"] != "auto":
            continue
        fitting = [(u["x_plain"], name) for name, u in uniform if u["peak"] <= row["budget"]]
        at_sac = result.get("sac_peak") is not None and row["budget"] == result["sac_peak"]
        best = min(fitting) if fitting else None
        best_row = result["rows"][best[1]] if best else None
        # Paired: auto's time over the best's in the same round, median over rounds.
        ratio = median([a / b for a, b in zip(row["round_s"], best_row["round_s"])]) \
            if best else None
        out.append({"budget": row["budget"], "auto_s": row["time_s"], "auto_peak": row["peak"],
                    "fits": row["peak"] <= row["budget"], "best": best[1] if best else None,
                    "best_s": best_row["time_s"] if best else None, "ratio": ratio,
                    "choices": row["choices"], "at_sac_peak": at_sac,
                    "over_sac": median([a / b for a, b in zip(
                        row["round_s"], result["rows"]["torch_sac"]["round_s"])])
                    if at_sac else None})
    return out


def print_result(result):
    link = "the CPU as it is" if not result["link_ratio"] else (
        f"simulated link {result['link_gbps']:.3f} GB/s: storing offload's "
        f"{result['calibration']['offload_stored_bytes'] / MIB:.1f} MiB takes "
        f"{result['link_ratio']:g}x plain's "
        f"{result['calibration']['plain_step_s'] * 1e3:.1f} ms step")
    print(f"\n== {result['model']}; {link}")
    print(f"   reachable peaks (predicted): {result['smallest'] / MIB:.1f} MiB smallest, "
          f"{result['kept'] / MIB:.1f} MiB every block kept")
    print(f"   {'variant':<24} {'ms/step':>9} {'x plain':>8} {'peak MiB':>9}  plan")
    for label, row in result["rows"].items():
        plan = ",".join(c.replace("checkpoint+offload", "c+o").replace("checkpoint", "ckpt")
                        for c in row["choices"]) if row["choices"] else ""
        print(f"   {label:<24} {row['time_s'] * 1e3:9.1f} {row['x_plain']:8.2f} "
              f"{row['peak'] / MIB:9.1f}  {plan}")
    for label, error in result["errors"].items():
        print(f"   {label}: {error}")
    print(f"   {'budget MiB':>10} {'auto ms':>8} {'peak':>6} {'fits':>5} "
          f"{'best other that fits':>24} {'ms':>8} {'auto/best':>9}")
    for c in compare(result):
        best = f"{c['best']:>24} {c['best_s'] * 1e3:8.1f} {c['ratio']:9.2f}" if c["best"] \
            else f"{'none fits':>24} {'':>8} {'':>9}"
        sac = f"  (SAC's peak: auto/torch_sac {c['over_sac']:.2f})" if c["at_sac_peak"] else ""
        print(f"   {c['budget'] / MIB:10.1f} {c['auto_s'] * 1e3:8.1f} {c['auto_peak'] / MIB:6.1f} "
              f"{'yes' if c['fits'] else 'NO':>5} {best}{sac}")
    if result["mismatches"]:
        print(f"   GRADIENTS DIFFER from plain autograd: {', '.join(result['mismatches'])}")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ratios = sorted({r["link_ratio"] for r in results})
    models = list(dict.fromkeys(r["name"] for r in results))
    fig, grid = plt.subplots(len(ratios), len(models), figsize=(6.5 * len(models),
                                                                4.8 * len(ratios)), squeeze=False)
    axes = [[grid[ratios.index(r["link_ratio"])][models.index(r["name"])] for r in results]]
    markers = {"plain": "s", "offload": "^", "checkpoint": "v", "checkpoint+offload": "D",
               "torch_checkpoint": "x", "selective": "P", "torch_sac": "*", "compile": "h"}
    for ax, result in zip(axes[0], results):
        autos = sorted((c["budget"], c["auto_s"], c["auto_peak"]) for c in compare(result))
        ax.plot([b / MIB for b, _, _ in autos], [t * 1e3 for _, t, _ in autos], "o-",
                color="tab:blue", label="auto (x: budget)")
        ax.plot([p / MIB for _, _, p in autos], [t * 1e3 for _, t, _ in autos], "o",
                mfc="none", color="tab:blue", label="auto (x: measured peak)")
        for label, row in result["rows"].items():
            if row["kind"] != "auto":
                ax.plot(row["peak"] / MIB, row["time_s"] * 1e3, markers[row["kind"]],
                        markersize=9, label=f"{label} (x: measured peak)")
        ax.set_title(f"{result['model']}, link x{result['link_ratio']:g}"
                     if result["link_ratio"] else result["model"], fontsize=9)
        ax.set_xlabel("memory: budget or measured peak (MiB)")
        ax.set_ylabel("step time (ms, median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,encoder")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=8,
                        help="auto steps before timing (profiling, candidates, corrections)")
    parser.add_argument("--min-bytes", type=int, default=64 << 10)
    parser.add_argument("--candidates", type=int, default=3,
                        help="wrap(candidates=): plans auto measures before committing (1: none)")
    parser.add_argument("--plot", default=None, help="write the trade-off plot (PNG) here")
    parser.add_argument("--link-ratios", default="0",
                        help="comma-separated: 0 the CPU as it is, R a simulated link on which "
                        "offload's stores take R x plain's step")
    parser.add_argument("--compile-budgets", default="0.1,0.3,0.5,0.7,0.9",
                        help="torch.compile of the whole model at these "
                        "activation_memory_budget values (peers; empty: none)")
    parser.add_argument("--from-json", default=None,
                        help="print (and --plot) the results a --json run wrote, running nothing")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the models and batches on the GPU, the peak is the "
                        "caching allocator's, the link is the real one (--link-ratios 0)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 round of 1 step, small models")
    parser.add_argument("--address", default="")
    parser.add_argument("--actstashd", default=None)
    parser.add_argument("--pool-size", default="8GiB",
                        help="the private daemon's pool: every variant holds its own leases")
    for name, default in (("gpt-layers", 6), ("gpt-dim", 256), ("gpt-heads", 4),
                          ("gpt-vocab", 1024), ("gpt-context", 128), ("gpt-batch", 8),
                          ("enc-layers", 4), ("enc-dim", 256), ("enc-heads", 4), ("enc-ff", 1024),
                          ("enc-seq", 128), ("enc-batch", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        for result in results:
            print_result(result)
        if args.plot:
            plot(results, args.plot)
        return 0
    if args.device == "cuda":
        if args.link_ratios != "0":
            parser.error("--device cuda runs on the real link: --link-ratios 0")
        # Deterministic kernels, so that "bitwise" compares the plans, not atomics.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    reexec_with_mmap_threshold()
    args.compile_budgets = [float(b) for b in args.compile_budgets.split(",") if b]
    if args.quick:
        args.rounds, args.steps, args.gpt_layers, args.gpt_dim, args.enc_dim = 1, 1, 4, 64, 64
        args.enc_ff = 256
        args.compile_budgets = args.compile_budgets[:1]
    actstash = import_actstash()
    import torch
    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("auto_plan_bench: --device cuda: no CUDA device here")
        return 77
    if args.device == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.compile_budgets:
        try:
            from torch._functorch import config as functorch_config
        except ImportError:  # torch 1.x
            functorch_config = None
        if not hasattr(functorch_config, "activation_memory_budget"):
            args.compile_budgets = []  # torch < 2.4
        else:  # one compiled model per budget, link and model: more than dynamo's default 8
            import torch._dynamo
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 256)
    sys.path.insert(0, EXAMPLES)
    specs = {"gpt": gpt_spec, "encoder": encoder_spec}
    results = []
    with daemon_address(args) as (address, _):
        for ratio in [float(r) for r in args.link_ratios.split(",")]:
            for name in args.models.split(","):
                spec = specs[name](torch, args)
                if args.device == "cuda":
                    spec = on_cuda(torch, spec)
                results.append(bench_model(torch, actstash, spec, address, args, ratio))
                if not args.json:
                    print_result(results[-1])
    if args.json:
        print(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 1 if any(r["mismatches"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
