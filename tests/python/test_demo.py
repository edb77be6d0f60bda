"""The demo: every mode trains with gradients bitwise equal to plain autograd,
and offload cuts the activation memory the trainer holds by at least 90%;
scripts/demo keeps the daemon's log when the daemon fails."""
import json
import os
import shutil
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


def test_the_demo_keeps_the_daemon_log_when_the_daemon_fails():
    """scripts/demo with a daemon that cannot start (a pool size it refuses) fails and
    keeps the daemon's log, naming it, instead of deleting it with its folder."""
    env = dict(os.environ, ACTSTASH_DEMO_POOL_SIZE="nonsense")
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "demo")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    marker = "the daemon's log is kept: "
    assert marker in out.stderr, out.stderr
    log = out.stderr.split(marker, 1)[1].split()[0]
    try:
        with open(log) as f:
            assert "pool_size: not a byte size: 'nonsense'" in f.read()
    finally:
        shutil.rmtree(os.path.dirname(log), ignore_errors=True)
