#!/usr/bin/env python3
"""The same MLP through both front-ends of the saved-tensor engine: the Python
hooks (here) and the libtorch adapter (build/bench/adapter_bench, run from here),
each with and without injected copy delays, each against plain autograd measured
in the same process. Prints one table (and --json).

    /usr/bin/python3 bench/adapter_compare.py [--steps 10] [--rounds 3] [--delay-us 300]

Model (as adapter_bench.cc): `layers` blocks of Linear(width, width) -> GELU ->
Dropout(0.1), then a sum; batch x width input; one torch thread; min_bytes 64 KiB.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "testing", "python"))
from actstash_testing.paths import BUILD, BUILD_PYTHON  # noqa: E402

sys.path.insert(0, BUILD_PYTHON)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import actstash  # noqa: E402

sys.path.insert(0, HERE)
from hook_bench import start_daemon  # noqa: E402


def python_front_end(args, socket):
    torch.manual_seed(0)
    weights = [(torch.randn(args.width, args.width) * 0.02).requires_grad_()
               for _ in range(args.layers)]
    biases = [torch.zeros(args.width, requires_grad=True) for _ in range(args.layers)]
    x = torch.randn(args.batch, args.width)

    def loss():
        h = x
        for w, b in zip(weights, biases):
            h = F.dropout(F.gelu(F.linear(h, w, b)), 0.1, True)
        return h.sum()

    stashes = {"offload": actstash.connect(socket, name="compare"),
               "offload-delayed": actstash.connect(socket, name="compare-delayed",
                                                   copy_delay_us=args.delay_us, seed=1)}

    def step(variant):
        start = time.perf_counter()
        if variant == "plain":
            out = loss()
        else:
            with stashes[variant].offload(min_bytes=64 << 10):
                out = loss()
        out.backward()
        return (time.perf_counter() - start) * 1e3

    names = ["plain", "offload", "offload-delayed"]
    times = {n: [] for n in names}
    ratios = {n: [] for n in names}
    for _ in range(args.rounds):
        medians = {}
        for n in names:
            step(n)  # warm-up
            medians[n] = statistics.median(step(n) for _ in range(args.steps))
            times[n].append(medians[n])
        for n in names:
            ratios[n].append(medians[n] / medians["plain"])
    s = stashes["offload-delayed"].stats()
    assert s["tensors_offloaded"] > 0, s
    assert s["tensors_fetched"] + s["unpacked_from_source"] == s["tensors_offloaded"], s
    assert s["inline_stores"] == 0, s
    out = {"front_end": "python", "delay_us": args.delay_us}
    for n in names:
        out[f"{n}_ms"] = statistics.median(times[n])
        out[f"{n}_x_plain"] = statistics.median(ratios[n])
    for stash in stashes.values():
        stash.close()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delay-us", type=int, default=300)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    daemon = start_daemon()
    socket = daemon.socket
    try:
        py = python_front_end(args, socket)
        command = [os.path.join(BUILD, "bench", "adapter_bench"), "--json", "--address", socket,
                   "--steps", str(args.steps), "--rounds", str(args.rounds),
                   "--delay-us", str(args.delay_us), "--layers", str(args.layers),
                   "--width", str(args.width), "--batch", str(args.batch)]
        cpp = json.loads(subprocess.run(command, check=True, capture_output=True,
                                        text=True).stdout.strip().splitlines()[-1])
    finally:
        daemon.stop()
    if args.json:
        print(json.dumps({"python": py, "libtorch": cpp}))
        return
    print(f"adapter_compare: MLP {args.layers}x{args.width}, batch {args.batch}, "
          f"{args.rounds} rounds x {args.steps} steps, copy delay {args.delay_us} us "
          "(median step ms; x plain of the same front-end)")
    print(f"  {'variant':18s} {'python ms':>10s} {'x plain':>8s} {'libtorch ms':>12s} "
          f"{'x plain':>8s}")
    for n in ("plain", "offload", "offload-delayed"):
        print(f"  {n:18s} {py[n + '_ms']:10.2f} {py[n + '_x_plain']:8.3f} "
              f"{cpp[n + '_ms']:12.2f} {cpp[n + '_x_plain']:8.3f}")


if __name__ == "__main__":
    main()
