"""bench/gpu_step_bench.py's own code, without a GPU (--cpu-dry-run): every
variant of both models runs on the CPU with a tiny model, the actstash variants
are bitwise equal to plain and move bytes through the daemon, and the peers
that cannot run here (SAC before torch 2.4) say why instead of failing. On a torch with transformers
>= 5.17 (the pip lanes) transformers' own checkpoint offload runs too."""
import csv
import inspect
import os
import subprocess
import sys

from conftest import PACKAGE_ENV, ROOT, daemon_binary


def _dry_run(bench, tmp_path, timeout):
    """bench/<bench> --cpu-dry-run against the daemon under test: its CSV rows."""
    out_csv = tmp_path / "rows.csv"
    env = dict(os.environ, ACTSTASH_DAEMON_BINARY=daemon_binary(), **PACKAGE_ENV)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", bench), "--cpu-dry-run",
         "--csv", str(out_csv)], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return list(csv.DictReader(open(out_csv)))


def test_step_bench_dry_run_runs_every_variant(tmp_path):
    rows = {(r["model"], r["variant"]): r for r in _dry_run("gpu_step_bench.py", tmp_path, 900)}
    gpt = [v for m, v in rows if m == "gpt"]
    assert gpt == ["plain", "torch.checkpoint", "torch SAC", "save_on_cpu", "actstash offload",
                   "actstash ckpt+offload", "actstash selective", "actstash auto (1/4)",
                   "actstash auto (middle)", "actstash auto (3/4)"]
    from torch.utils import checkpoint as torch_cp
    has_sac = hasattr(torch_cp, "create_selective_checkpoint_contexts")
    for variant in gpt:
        if variant in ("torch SAC", "actstash selective") and not has_sac:
            assert "selective activation checkpointing" in rows[("gpt", variant)]["skipped"]
            continue
        assert not rows[("gpt", variant)]["skipped"], variant
        assert rows[("gpt", variant)]["bitwise"] == "True", variant
    assert float(rows[("gpt", "actstash offload")]["offloaded_mib"]) > 0
    assert float(rows[("gpt", "actstash offload")]["fetched_mib"]) > 0

    llama = {v: r for (m, v), r in rows.items() if m == "llama"}
    assert set(llama) == {"plain", "transformers checkpoint", "transformers ckpt+offload",
                          "torchtune offload+ckpt", "actstash offload",
                          "actstash ckpt+offload", "actstash via HF checkpoint"}
    try:
        import transformers
    except ImportError:
        for variant, r in llama.items():
            assert "transformers not installed" in r["skipped"], variant
        return
    # torchtune's offload copies on CUDA streams: never on the CPU.
    assert "needs CUDA" in llama["torchtune offload+ckpt"]["skipped"]
    for variant in ("plain", "transformers checkpoint", "actstash offload",
                    "actstash ckpt+offload", "actstash via HF checkpoint"):
        assert not llama[variant]["skipped"], (variant, llama[variant]["skipped"])
        assert llama[variant]["bitwise"] == "True", variant
    assert float(llama["actstash offload"]["offloaded_mib"]) > 0
    enable = getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None) or \
        transformers.PreTrainedModel.gradient_checkpointing_enable
    has_offload = "offload" in inspect.signature(enable).parameters
    if has_offload:
        assert not llama["transformers ckpt+offload"]["skipped"]
        assert llama["transformers ckpt+offload"]["bitwise"] == "True"
    else:
        assert "offload=" in llama["transformers ckpt+offload"]["skipped"]


def test_optimizer_bench_dry_run_runs_every_variant(tmp_path):
    """bench/gpu_optimizer_bench.py's own code on the CPU: torch's AdamW and
    OffloadAdamW's device path (on the simulated device) train the same tiny GPT;
    OffloadAdamW's states are in the pool, torch's are not."""
    rows = {r["variant"]: r for r in _dry_run("gpu_optimizer_bench.py", tmp_path, 600)}
    assert list(rows) == ["torch AdamW foreach", "torch AdamW foreach=False",
                          "actstash OffloadAdamW exact", "actstash OffloadAdamW fast"]
    for name, r in rows.items():
        assert float(r["step_ms"]) > 0
        assert (float(r["pool_mib"]) > 0) == name.startswith("actstash"), name
    # The same training: torch's single-tensor step and OffloadAdamW's exact one agree.
    assert rows["torch AdamW foreach=False"]["loss"] == rows["actstash OffloadAdamW exact"]["loss"]
