"""Real training loops: DDP ranks sharing one daemon, gradient accumulation,
autocast, no_grad/inference_mode, optimizers with state, and
actstash.checkpoint against torch.utils.checkpoint(use_reentrant=False)."""
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import actstash
from conftest import PACKAGE_ENV, ROOT
from gpt import GPT, Block, loss_fn

torch.set_num_threads(1)
DDP_SCRIPT = os.path.join(ROOT, "examples", "train_ddp.py")


def _env(daemon, **extra):
    return dict(os.environ, ACTSTASH_ADDRESS=daemon.socket,
                **PACKAGE_ENV, **extra)


def _run_ddp(daemon, tmp_path, name, *args):
    out = tmp_path / name
    out.mkdir()
    proc = subprocess.run([sys.executable, DDP_SCRIPT, "--out", str(out), *args],
                          env=_env(daemon), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def _same_tensors(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("ranks", [2, 4])
def test_ddp_ranks_match_ddp_without_offload(daemon, tmp_path, ranks):
    common = ["--ranks", str(ranks), "--steps", "3"]
    ref, _ = _run_ddp(daemon, tmp_path, "ref", "--mode", "none", *common)
    off, stdout = _run_ddp(daemon, tmp_path, "off", "--mode", "offload", *common)
    for r in range(ranks):
        a, b = torch.load(ref / f"rank{r}.pt"), torch.load(off / f"rank{r}.pt")
        assert _same_tensors(a["grads"], b["grads"]), f"rank {r} gradients"
        assert _same_tensors(a["params"], b["params"]), f"rank {r} parameters"
    assert stdout.count("offloaded") == ranks


def test_ddp_with_offload_adamw_matches_torch_adamw(daemon, tmp_path):
    """Two ranks, one daemon, 4 accumulated micro-batches per step: Adam's states of
    each rank in the pool (OffloadAdamW), activations offloaded too; parameters
    bitwise equal to DDP with torch's AdamW and nothing offloaded."""
    common = ["--ranks", "2", "--steps", "3", "--accumulate", "4"]
    ref, _ = _run_ddp(daemon, tmp_path, "ref", "--mode", "none", *common)
    off, stdout = _run_ddp(daemon, tmp_path, "off", "--mode", "offload", "--optimizer",
                           "offload-adamw", *common)
    for r in range(2):
        a, b = torch.load(ref / f"rank{r}.pt"), torch.load(off / f"rank{r}.pt")
        assert _same_tensors(a["params"], b["params"]), f"rank {r} parameters"
    # Each rank's activations and optimizer state went to the daemon.
    reports = [line for line in stdout.splitlines() if line.startswith("rank ")]
    assert len(reports) == 2, stdout
    for report in reports:
        assert "offloaded 0.0 MiB" not in report, report
        assert "optimizer state in the pool 0.0 MiB" not in report, report


def test_ddp_rank_quotas_are_separate(daemon, tmp_path):
    common = ["--ranks", "2", "--steps", "2"]
    ref, _ = _run_ddp(daemon, tmp_path, "ref", "--mode", "none", *common)
    # Rank 1 may hold only 64 KiB: its stores fail (StashFull) and, in keep
    # mode, its tensors stay in-process; rank 0 offloads as usual.
    off, stdout = _run_ddp(daemon, tmp_path, "off", "--mode", "offload", "--on-unavailable",
                           "keep", "--rank-quota", "1:65536", *common)
    for r in range(2):
        a, b = torch.load(ref / f"rank{r}.pt"), torch.load(off / f"rank{r}.pt")
        assert _same_tensors(a["params"], b["params"]), f"rank {r}"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_killed_rank_is_reclaimed_and_the_daemon_serves_the_others(daemon):
    env = _env(daemon, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, DDP_SCRIPT, "--steps", "100000", "--timeout", "10",
                               "--layers", "4", "--dim", "128"],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for proc in ranks:  # both ranks are training
            for _ in range(3):
                json.loads(proc.stdout.readline())
        observer = actstash.connect(daemon.socket)
        sessions = observer.client.stats(all_sessions=True)["all_sessions"]
        by_pid = {s["peer_pid"]: s for s in sessions if s["attached"]}
        for proc in ranks:
            assert proc.pid in by_pid, "every rank has its own session, with its pid"
            assert by_pid[proc.pid]["leased_bytes"] > 0
        victim = by_pid[ranks[1].pid]["session_id"]

        ranks[1].send_signal(signal.SIGKILL)
        ranks[1].wait()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            ids = [s["session_id"] for s in observer.client.stats(True)["all_sessions"]]
            if victim not in ids:
                break
            time.sleep(0.02)
        assert victim not in ids, "the killed rank's session was reclaimed within 1 s"

        _, err = ranks[0].communicate(timeout=120)
        assert ranks[0].returncode != 0, "the survivor fails the collective, as DDP does"
        assert "StashUnavailable" not in err and "actstash" not in err.split("\n")[-2], err[-2000:]
        # The daemon goes on serving.
        fresh = actstash.connect(daemon.socket)
        assert fresh.client.attached
        fresh.close()
        observer.close()
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()


def _model():
    torch.manual_seed(0)
    return GPT(vocab=256, dim=64, heads=4, layers=2, context=32, dropout=0.1)


def _batches(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 33), generator=g) for _ in range(n)]


def test_gradient_accumulation_releases_every_micro_batch(daemon):
    stash = actstash.connect(daemon.socket)
    plain, offloaded = _model(), _model()
    actstash.wrap(offloaded, stash, blocks=Block, mode="offload", min_bytes=0)
    opt_a = torch.optim.SGD(plain.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(offloaded.parameters(), lr=0.01)
    baseline = stash.client.stats()["self"]["client"]["objects"]
    # 12 optimizer steps of 4 micro-batches: every micro-batch's activations
    # go to the daemon and are all released once its backward is done.
    for step in range(12):
        for micro, idx in enumerate(_batches(4, seed=step)):
            torch.manual_seed(1000 * step + micro)
            loss_fn(plain, idx).backward()
            offloaded_before = stash.stats()["bytes_offloaded"]
            torch.manual_seed(1000 * step + micro)
            loss_fn(offloaded, idx).backward()
            stash.synchronize()
            gc.collect()
            assert stash.stats()["bytes_offloaded"] > offloaded_before, (step, micro)
            assert stash.stats()["live_bytes"] == 0, (step, micro)
            assert stash.client.stats()["self"]["client"]["objects"] == baseline, (step, micro)
        if step % 3 == 0:
            assert _same_tensors([p.grad for p in plain.parameters()],
                                 [p.grad for p in offloaded.parameters()]), step
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    assert _same_tensors(list(plain.parameters()), list(offloaded.parameters()))
    stash.close()


def test_adamw_twenty_steps_bitwise(daemon):
    stash = actstash.connect(daemon.socket, copy_delay_us=100)
    plain, offloaded = _model(), _model()
    actstash.wrap(offloaded, stash, blocks=Block, mode="checkpoint+offload", min_bytes=0)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, offloaded)]
    for step, idx in enumerate(_batches(20)):
        for model, opt in zip((plain, offloaded), opts):
            torch.manual_seed(step)
            opt.zero_grad(set_to_none=True)
            loss_fn(model, idx).backward()
            opt.step()
    assert _same_tensors(list(plain.parameters()), list(offloaded.parameters()))
    stash.close()


def test_autocast_bf16_offloads_both_dtypes(daemon):
    stash = actstash.connect(daemon.socket)
    seen = set()
    pack = stash._pack

    def spy(t, *args, **kwargs):
        packed = pack(t, *args, **kwargs)
        if packed is not t:  # offloaded
            seen.add(t.dtype)
        return packed

    stash._pack = spy
    grads = []
    for use_stash in (False, True):
        model = _model()
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if use_stash:
                with stash.offload(min_bytes=0):
                    loss = loss_fn(model, _batches(1)[0])
            else:
                loss = loss_fn(model, _batches(1)[0])
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert _same_tensors(*grads)
    assert {torch.bfloat16, torch.float32} <= seen, seen
    stash.close()


@pytest.mark.parametrize("guard", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_store_nothing(daemon, guard):
    stash = actstash.connect(daemon.socket)
    model = _model().eval()
    idx = _batches(1)[0][:, :-1]
    with guard():
        expected = model(idx)
        with stash.offload(min_bytes=0):
            actual = model(idx)
    assert torch.equal(expected, actual)
    assert stash.stats()["tensors_offloaded"] == 0
    stash.close()


class BNBlock(nn.Module):
    """Buffers updated in forward, keyword and non-tensor arguments, tuple and
    dict outputs, dropout."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, scale, *, shift=None, tag="t"):
        h = self.drop(self.bn(self.lin(x))) * scale
        if shift is not None:
            h = h + shift
        return h.relu(), {"tag": tag, "sum": h.sum()}


@pytest.mark.parametrize("requires_grad", [True, False])
def test_checkpoint_behaves_like_torch_checkpoint(daemon, requires_grad):
    stash = actstash.connect(daemon.socket)
    results = []
    for use_ours in (False, True):
        torch.manual_seed(0)
        block = BNBlock()
        x = torch.randn(16, 32, requires_grad=requires_grad)
        shift = torch.randn(32)
        torch.manual_seed(42)
        if use_ours:
            out, extra = actstash.checkpoint(block, x, 2.0, shift=shift, tag="ours",
                                             stash=stash)
        else:
            out, extra = torch_checkpoint(block, x, 2.0, shift=shift, tag="ours",
                                          use_reentrant=False)
        (out.sum() + extra["sum"]).backward()
        after_rng = torch.rand(3)  # the RNG was consumed exactly alike
        results.append(dict(
            grads=[p.grad for p in block.parameters()],
            x_grad=[x.grad] if requires_grad else [],
            buffers=[b.clone() for b in block.buffers()],
            rng=after_rng, tag=extra["tag"]))
    torch_result, ours = results
    assert _same_tensors(torch_result["grads"], ours["grads"])
    assert _same_tensors(torch_result["x_grad"], ours["x_grad"])
    assert _same_tensors(torch_result["buffers"], ours["buffers"]), "BatchNorm running stats"
    assert torch.equal(torch_result["rng"], ours["rng"])
    assert ours["tag"] == "ours"
    stash.close()
