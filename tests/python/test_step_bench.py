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


def _pareto(args, timeout=900):
    env = dict(os.environ, ACTSTASH_DAEMON_BINARY=daemon_binary(), **PACKAGE_ENV)
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "auto_plan_bench.py")] +
                          args, env=env, capture_output=True, text=True, timeout=timeout)


def test_pareto_bench_quick_runs_the_plans_and_the_peers(tmp_path):
    """bench/auto_plan_bench.py --quick on a simulated link of 4x: every actstash
    variant bitwise (the bench exits 1 otherwise), auto at every budget, a budget at
    SAC's measured peak where torch has SAC, torch.compile's peer where it has
    activation_memory_budget (or its error, where inductor cannot compile here), and
    --from-json prints the same run again."""
    import json
    from torch.utils import checkpoint as torch_cp
    # A 4 GiB pool: the bench's 8 GiB default took over 30 s to map on a loaded machine.
    proc = _pareto(["--quick", "--models", "gpt", "--link-ratios", "4", "--json",
                    "--pool-size", "4GiB"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = json.loads(proc.stdout)
    assert result["link_ratio"] == 4 and result["link_gbps"] > 0 and not result["mismatches"]
    kinds = {row["kind"] for row in result["rows"].values()}
    assert {"plain", "offload", "checkpoint", "auto"} <= kinds
    autos = [row for row in result["rows"].values() if row["kind"] == "auto"]
    assert len(autos) + len([k for k in result["errors"] if k.startswith("auto")]) == \
        len(result["budgets"])
    has_sac = hasattr(torch_cp, "create_selective_checkpoint_contexts")
    assert ("torch_sac" in kinds) == has_sac
    if has_sac:
        assert result["sac_peak"] in result["budgets"]
        compiled = [k for k in result["rows"] if k.startswith("compile@")] + \
            [k for k in result["errors"] if k.startswith("compile@")]
        assert compiled == ["compile@0.1"], (compiled, result["errors"])
    saved = tmp_path / "run.json"
    saved.write_text(proc.stdout)
    again = _pareto(["--from-json", str(saved)], timeout=120)
    assert again.returncode == 0 and "auto/best" in again.stdout, again.stderr


def test_pareto_bench_on_cuda_without_a_device_says_so():
    import pytest
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = _pareto(["--device", "cuda", "--quick", "--models", "gpt", "--pool-size", "1GiB"],
                   timeout=300)
    assert proc.returncode == 77 and "no CUDA device" in proc.stdout, proc.stderr[-2000:]
