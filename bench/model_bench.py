#!/usr/bin/env python3
"""model_bench: training step time of real models on CPU with actstash offload,
next to plain autograd, per-layer torch checkpointing and torch's save_on_cpu,
measured in one process, variants interleaved.

    bench/model_bench.py                   # starts a private actstashd
    bench/model_bench.py --quick           # a smoke run
    bench/model_bench.py --address SOCKET  # an actstashd already running
    bench/model_bench.py --json            # machine-readable output

Models (fp32, CPU, --threads torch threads, default 1 as in scripts/demo):
  gpt      examples/gpt.py's GPT with the config scripts/demo trains
           (examples/train_gpt.py's defaults): 6 blocks, width 256, 4 heads,
           vocabulary 1024, batch 8 x 128 tokens, dropout 0.1; cross-entropy.
  encoder  torch.nn.TransformerEncoder: 4 layers of TransformerEncoderLayer
           (d_model 256, 4 heads, feed-forward 1024, dropout 0.1, batch_first),
           batch 2 x 128 random inputs (tens of ms per step on one core);
           MSE loss against a random target.
Variants (each its own copy of the same initial model, its own SGD (lr 0.01)):
  plain       plain autograd
  actstash    actstash.wrap(model, stash, blocks=<layer class>, mode="offload",
              min_bytes=--min-bytes) as the demo does: saved tensors of at
              least min_bytes (64 KiB) inside each block go to actstashd
  checkpoint  torch.utils.checkpoint.checkpoint(use_reentrant=False) per layer
  save_on_cpu torch.autograd.graph.save_on_cpu() around forward (on a CPU
              trainer its copies stay in the process: the hooks' cost alone)
  actstash_checkpoint, actstash_checkpoint_offload (not run by default)
              wrap(mode="checkpoint") and wrap(mode="checkpoint+offload")
With --compile every layer is compiled after it is wrapped (torch.compile);
under inductor the checkpointed variants are compared (bitwise) with torch's
checkpoint, which is not bitwise equal to compiled plain autograd itself.
A step is zero_grad, forward, backward, optimizer step; step k of every
variant of a model uses the same batch and seed (torch.manual_seed(100 + k),
for dropout), so all variants see the same sequence of parameters as long as
their gradients are bitwise equal to plain autograd's. Per round and model,
each variant runs --warmup untimed steps then --steps timed ones (median); the
variants' order rotates from round to round, and "x plain" is the median over
rounds of the per-round ratio to plain (or to --baseline), so each ratio pairs
runs made close together; "spread" is the least and the largest of those
ratios. What a ratio means here: on virtual machines a first write to a fresh
page costs 5-12 us, and glibc's heap hands memory back and takes it again
depending on what was freed before, so the same variant's step moves by
several percent between rounds (faults/step shows those first touches); a
median of paired rounds and its spread are the figure, one round is not.
No stash.synchronize() inside a timed step (stores overlap the rest of forward
and backward, as in training); the stash is synchronized between
variants, outside the timing. Between steps, outside the timing, the benchmark
reads the stash's counters and hashes the gradients (work of the previous
step still in flight, such as releases, may finish there).

Every step's gradients are hashed (SHA-256 of all parameters' gradient bytes,
outside the timing) and compared with plain autograd's of the same step: the
actstash variant must be bitwise equal (the benchmark exits 1 otherwise); the
others are reported. "faults/step" is the trainer's minor page faults in a
timed step (getrusage; first touches of memory the allocator took from the
system), a cost of its own that a variant changes by what it frees and when.
"offloaded MiB/step" and "tensors/step" come from the stash's counters
(bytes_offloaded, tensors_offloaded) over each timed step; after each actstash
run the benchmark checks that nothing stays live in the daemon (live_bytes 0)
once the graph is freed.
"""
import argparse
import copy
import gc
import hashlib
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "testing", "python"))
from actstash_testing.paths import EXAMPLES  # noqa: E402
from hook_bench import (Checks, daemon_address, finish, import_actstash,  # noqa: E402
                        median, parse_size, print_checks, scalar_stats)

sys.path.insert(0, EXAMPLES)

VARIANTS = ["plain", "actstash", "checkpoint", "save_on_cpu", "actstash_checkpoint",
            "actstash_checkpoint_offload"]
DEFAULT_VARIANTS = VARIANTS[:4]
# The variants that use the stash, and the wrap mode of each.
STASH_MODES = {"actstash": "offload", "actstash_checkpoint": "checkpoint",
               "actstash_checkpoint_offload": "checkpoint+offload"}
# Engine counters read around each timed actstash step (JSON: their sums).
STEP_COUNTERS = ("bytes_offloaded", "tensors_offloaded", "tensors_kept", "tensors_fetched",
                 "views", "unpacked_from_source", "inline_stores", "wait_ns")


class ModelSpec:
    """A model to benchmark: how to build it, its layer class, its batches and loss."""

    def __init__(self, name, describe, build, layers, layer_class, make_batch, loss):
        self.name, self.describe, self.build = name, describe, build
        self.layers, self.layer_class = layers, layer_class
        self.make_batch, self.loss = make_batch, loss


def gpt_spec(torch, args):
    from gpt import GPT, Block, loss_fn

    def build():
        return GPT(vocab=args.gpt_vocab, dim=args.gpt_dim, heads=args.gpt_heads,
                   layers=args.gpt_layers, context=args.gpt_context, dropout=0.1)

    def make_batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randint(0, args.gpt_vocab, (args.gpt_batch, args.gpt_context + 1),
                             generator=g)

    return ModelSpec(
        "gpt",
        f"GPT (examples/gpt.py) {args.gpt_layers}x{args.gpt_dim}, {args.gpt_heads} heads, "
        f"vocab {args.gpt_vocab}, batch {args.gpt_batch}x{args.gpt_context}",
        build, lambda m: list(m.blocks), Block, make_batch, loss_fn)


def encoder_spec(torch, args):
    nn = torch.nn

    def build():
        layer = nn.TransformerEncoderLayer(args.enc_dim, args.enc_heads, args.enc_ff,
                                           dropout=0.1, batch_first=True)
        return nn.TransformerEncoder(layer, args.enc_layers, enable_nested_tensor=False)

    def make_batch(step):
        g = torch.Generator().manual_seed(2000 + step)
        shape = (args.enc_batch, args.enc_seq, args.enc_dim)
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g)

    def loss(model, batch):
        x, target = batch
        return nn.functional.mse_loss(model(x), target)

    return ModelSpec(
        "encoder",
        f"nn.TransformerEncoder {args.enc_layers}x{args.enc_dim}, {args.enc_heads} heads, "
        f"ff {args.enc_ff}, batch {args.enc_batch}x{args.enc_seq}",
        build, lambda m: list(m.layers), nn.TransformerEncoderLayer, make_batch, loss)


def checkpoint_layers(layers, context_fn=None):
    """torch.utils.checkpoint per layer (use_reentrant=False); keyword arguments
    (the encoder's masks) are bound, the positional ones checkpointed. context_fn:
    torch's, e.g. sac_context for selective activation checkpointing."""
    from torch.utils.checkpoint import checkpoint
    extra = {} if context_fn is None else {"context_fn": context_fn}
    for layer in layers:
        original = layer.forward

        def forward(*args, _original=original, **kwargs):
            return checkpoint(lambda *a: _original(*a, **kwargs), *args, use_reentrant=False,
                              **extra)

        layer.forward = forward


def sac_context():
    """The peers' selective activation checkpointing (torch >= 2.4): the outputs of
    matrix products and convolutions saved, every other op recomputed. The policy is
    the one actstash's wrap(mode="selective") uses, so that the two rows differ only
    in what actstash adds (the input offloaded)."""
    from actstash._plan._wrap import _selective_context
    return _selective_context()


class Runner:
    """One variant of one model: its own model copy, optimizer and step counter."""

    def __init__(self, torch, spec, variant, initial, stash, args):
        self.torch, self.spec, self.variant, self.stash = torch, spec, variant, stash
        self.model = copy.deepcopy(initial)
        self.model.train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.step_index = 0
        self.context = None
        if variant in STASH_MODES:
            import actstash
            actstash.wrap(self.model, stash, blocks=spec.layer_class, mode=STASH_MODES[variant],
                          min_bytes=args.min_bytes)
        elif variant == "checkpoint":
            checkpoint_layers(spec.layers(self.model))
        elif variant == "save_on_cpu":
            self.context = lambda: torch.autograd.graph.save_on_cpu(pin_memory=False)
        if args.compile:
            for layer in spec.layers(self.model):
                layer.compile()  # after wrapping: what a user of torch.compile does
        self.digests = {}         # step index -> gradient digest
        self.offloaded = []       # per timed step: (bytes, tensors)
        self.faults = []          # per timed step: the trainer's minor page faults
        self.last_faults = 0

    def step(self, batch):
        """One training step; returns its time in seconds."""
        torch = self.torch
        torch.manual_seed(100 + self.step_index)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.context is not None:
            with self.context():
                loss = self.spec.loss(self.model, batch)
        else:
            loss = self.spec.loss(self.model, batch)
        loss.backward()
        self.optimizer.step()
        elapsed = time.perf_counter() - start
        self.last_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        del loss
        return elapsed

    def digest(self):
        h = hashlib.sha256()
        for p in self.model.parameters():
            h.update(b"none" if p.grad is None else p.grad.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    def run(self, warmup, steps, batches, checks):
        """warmup + steps steps; returns the timed steps' seconds."""
        times = []
        for i in range(warmup + steps):
            batch = batches(self.step_index)
            before = self.stash.stats() if self.stash is not None else None
            t = self.step(batch)
            if self.stash is not None:
                after = self.stash.stats()
                if i >= warmup:
                    self.offloaded.append({k: after[k] - before[k] for k in STEP_COUNTERS})
            self.digests[self.step_index] = self.digest()
            self.step_index += 1
            if i >= warmup:
                times.append(t)
                self.faults.append(self.last_faults)
        if self.stash is not None:
            gc.collect()
            self.stash.synchronize()
            stats = self.stash.stats()
            label = f"{self.spec.name} {self.variant} after step {self.step_index - 1}"
            checks.absolute(label, stats, {"live_tensors": 0, "live_bytes": 0, "in_flight": 0,
                                           "store_failures": 0})
        return times


def bench_model(torch, spec, stash, args, checks):
    torch.manual_seed(0)
    initial = spec.build()
    variants = args.variants
    runners = {v: Runner(torch, spec, v, initial, stash if v in STASH_MODES else None, args)
               for v in variants}
    per_round = []  # per round: variant -> median step seconds
    for rnd in range(args.rounds):
        shift = rnd % len(variants)
        order = variants[shift:] + variants[:shift]
        medians = {}
        for v in order:
            gc.collect()
            medians[v] = median(runners[v].run(args.warmup, args.steps, spec.make_batch, checks))
        per_round.append(medians)
    base = args.baseline if args.baseline in variants else (
        "plain" if "plain" in variants else variants[0])
    rows = []
    for v in variants:
        r = runners[v]
        # Under inductor, checkpointed layers are not bitwise equal to plain ones
        # (torch's own checkpoint neither): those compare with torch's checkpoint.
        ref = ("checkpoint" if args.compile and v in STASH_MODES and v != "actstash" and
               "checkpoint" in runners else base)
        compared = [k for k in r.digests if k in runners[ref].digests]
        equal = all(r.digests[k] == runners[ref].digests[k] for k in compared)
        row = {
            "variant": v,
            "step_ms": median([m[v] for m in per_round]) * 1e3,
            "x_plain": median([m[v] / m[base] for m in per_round]),
            # The spread of those per-round ratios (min, max): what one round can say.
            "x_plain_spread": [min(m[v] / m[base] for m in per_round),
                               max(m[v] / m[base] for m in per_round)],
            "round_step_ms": [round(m[v] * 1e3, 3) for m in per_round],
            "grads_equal": equal,
            "grads_compared_with": ref,
            "steps_compared": len(compared),
            "minor_faults_per_step": median(r.faults),
        }
        if r.offloaded:
            per_step = {k: [c[k] for c in r.offloaded] for k in STEP_COUNTERS}
            row["offloaded_bytes_per_step"] = median(per_step["bytes_offloaded"])
            row["offloaded_tensors_per_step"] = median(per_step["tensors_offloaded"])
            row["offloaded_bytes_per_step_min_max"] = [
                min(per_step["bytes_offloaded"]), max(per_step["bytes_offloaded"])]
            row["timed_steps_counters"] = {k: sum(v) for k, v in per_step.items()}
        rows.append(row)
        if v in STASH_MODES:
            checks.expect(f"{spec.name}: {v} gradients bitwise equal to {ref} "
                          f"({len(compared)} steps)", equal, True)
            if v != "actstash_checkpoint":
                checks.expect(f"{spec.name}: {v} offloaded something in every timed step",
                              bool(r.offloaded) and
                              min(c["bytes_offloaded"] for c in r.offloaded) > 0, True)
    return {"model": spec.name, "describe": spec.describe, "variants": rows, "baseline": base}


def print_report(result):
    cfg = result["config"]
    print(f"model_bench: torch {cfg['torch']}, {cfg['threads']} torch thread(s), "
          f"{cfg['rounds']} round(s) of {cfg['warmup']} warm-up + {cfg['steps']} timed steps "
          f"per variant (median), min_bytes {cfg['min_bytes']}, daemon {cfg['daemon']}")
    print("step ms: median over rounds of each round's median; x <baseline>: median of the "
          "per-round ratios (spread: their min-max)")
    for m in result["models"]:
        print()
        print(m["describe"])
        print(f"  {'variant':<28}{'step ms':>9}{'x ' + m['baseline'][:12]:>15}{'spread':>12}"
              f"{'grads equal':>13}"
              f"{'offloaded MiB/step':>20}{'tensors/step':>14}{'faults/step':>13}"
              "   per-round ms")
        for r in m["variants"]:
            off = (f"{r['offloaded_bytes_per_step'] / 2**20:>20.1f}"
                   f"{r['offloaded_tensors_per_step']:>14.0f}"
                   if "offloaded_bytes_per_step" in r else f"{'-':>20}{'-':>14}")
            rounds = " ".join(f"{t:.1f}" for t in r["round_step_ms"])
            lo, hi = r["x_plain_spread"]
            print(f"  {r['variant']:<28}{r['step_ms']:>9.1f}{r['x_plain']:>15.3f}"
                  f"{f'{lo:.2f}-{hi:.2f}':>12}"
                  f"{str(r['grads_equal']):>13}{off}{r['minor_faults_per_step']:>13.0f}"
                  f"   {rounds}")
        for r in m["variants"]:
            c = r.get("timed_steps_counters")
            if c:
                steps = len(r["round_step_ms"]) * result["config"]["steps"]
                print(f"  {r['variant']} per timed step: {c['tensors_fetched'] / steps:.0f} "
                      f"fetched ({c['views'] / steps:.0f} as views), "
                      f"{c['inline_stores'] / steps:.0f} stored inline, "
                      f"{c['tensors_kept'] / steps:.0f} kept, "
                      f"{c['unpacked_from_source'] / steps:.1f} read from the source "
                      f"(store in flight), waited {c['wait_ns'] / steps / 1e6:.2f} ms")
    print()
    print_checks(result["checks"], "checks", " (actstash gradients bitwise equal to plain, "
                 "nothing left live in the daemon)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,encoder", help="gpt,encoder (default both)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each layer (after wrapping; torch >= 2.1, a C++ "
                        "compiler); the wrap checkpoint variants are then compared with the "
                        "checkpoint variant (torch's, compiled): under inductor neither is "
                        "bitwise equal to compiled plain")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {','.join(VARIANTS)} (default: "
                        f"{','.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (variants interleaved)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--baseline", default="plain",
                        help="the variant ratios are taken against (x_plain in JSON; default "
                             "plain; e.g. checkpoint to compare actstash_checkpoint_offload with "
                             "torch's checkpoint)")
    parser.add_argument("--min-bytes", type=parse_size, default=64 << 10,
                        help="actstash offload threshold (default 64KiB)")
    parser.add_argument("--gpt-layers", type=int, default=6)
    parser.add_argument("--gpt-dim", type=int, default=256)
    parser.add_argument("--gpt-heads", type=int, default=4)
    parser.add_argument("--gpt-vocab", type=int, default=1024)
    parser.add_argument("--gpt-context", type=int, default=128)
    parser.add_argument("--gpt-batch", type=int, default=8)
    parser.add_argument("--enc-layers", type=int, default=4)
    parser.add_argument("--enc-dim", type=int, default=256)
    parser.add_argument("--enc-heads", type=int, default=4)
    parser.add_argument("--enc-ff", type=int, default=1024)
    parser.add_argument("--enc-seq", type=int, default=128)
    parser.add_argument("--enc-batch", type=int, default=2)
    parser.add_argument("--address", default="",
                        help="socket of a running actstashd (default: start a private one)")
    parser.add_argument("--actstashd", default=None, help="actstashd binary of a private daemon")
    parser.add_argument("--pool-size", default="2GiB", help="pool of a private daemon")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 round of 1 warm-up + 2 timed steps")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.steps = 1, 1, 2
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}")
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")

    import torch
    actstash = import_actstash()
    torch.set_num_threads(args.threads)
    specs = {"gpt": gpt_spec, "encoder": encoder_spec}
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in specs:
            parser.error(f"unknown model {m!r} (gpt, encoder)")
    checks = Checks()
    with daemon_address(args) as (address, daemon):
        stash = (actstash.connect(address, name="model_bench")
                 if any(v in STASH_MODES for v in args.variants) else None)
        result = {"config": {
            "torch": torch.__version__, "threads": args.threads, "rounds": args.rounds,
            "warmup": args.warmup, "steps": args.steps, "min_bytes": args.min_bytes,
            "quick": args.quick, "variants": args.variants, "compile": args.compile,
            "daemon": address if args.address else f"private ({args.pool_size} pool)",
        }}
        result["models"] = [bench_model(torch, specs[m](torch, args), stash, args, checks)
                            for m in models]
        if stash is not None:
            result["stats_actstash"] = scalar_stats(stash)
            stash.close()
        return finish(result, checks, daemon, args, print_report)  # the daemon's log is still there


if __name__ == "__main__":
    sys.exit(main())
