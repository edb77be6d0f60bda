"""The demo: every mode trains with gradients bitwise equal to plain autograd,
and offload cuts the activation memory the trainer holds by at least 90%."""
import json
import os
import subprocess
import sys

from conftest import PACKAGE_ENV, ROOT


def test_demo_modes(daemon):
    env = dict(os.environ, ACTSTASH_ADDRESS=daemon.socket,
               **PACKAGE_ENV)
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--json", "--steps",
         "2", "--layers", "4", "--dim", "128", "--context", "128", "--batch", "8"],
        env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    results = {r["mode"]: r for r in json.loads(out.stdout)}
    assert set(results) == {"none", "torch-checkpoint", "save_on_cpu", "actstash-offload",
                            "actstash-checkpoint+offload"}
    for mode, r in results.items():
        assert r["grads_equal"], mode
    for mode in ("actstash-offload", "actstash-checkpoint+offload"):
        assert results[mode]["held_ratio"] <= 0.10, (mode, results[mode])
        assert results[mode]["offloaded_bytes_per_step"] > 0
