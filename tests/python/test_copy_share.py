"""The node's copy share (actstashd --copy-bandwidth) end to end: the daemon divides its
node figure among the sessions copying at once, Stash.copy_share says so, and
wrap(policy="auto") plans with the smaller of its own probe and that share once other
sessions copy too (alone, its probe applies), follows it when other ranks start copying
(re-planned and checked, gradients still bitwise), and shows it in its report; several
trainer processes on one daemon each see the others."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import actstash
from actstash._plan import _auto
from actstash_testing.training import bitwise_equal, cloned_grads
from conftest import EXAMPLES, PACKAGE_ENV, TESTING_PYTHON, Daemon

# What this file tests does not depend on torch's version (conftest.py).
pytestmark = pytest.mark.torch_agnostic

NODE_BPS = 40e6  # slower than any probe of this machine: the share decides the rates


@pytest.fixture
def share_daemon():
    d = Daemon(extra=("--copy-bandwidth", "40MB/s"))
    yield d
    d.stop()


def test_copy_share_divides_the_node_among_copying_sessions(share_daemon):
    a, b = actstash.connect(share_daemon.socket), actstash.connect(share_daemon.socket)
    try:
        first = a.copy_share(2e9, 3e9)
        assert first["node"] == {"node_bytes_per_second": NODE_BPS, "node_source": "configured",
                                 "copying_sessions": 1, "window_seconds": 30}
        assert first["share_bytes_per_second"] == NODE_BPS
        assert b.copy_share()["share_bytes_per_second"] == NODE_BPS / 2
        stats = a.client.stats(all_sessions=True)
        assert stats["copy"]["copying_sessions"] == 2
        assert sorted(s["probe_store_bytes_per_second"] for s in stats["all_sessions"]) == \
            [0, 2e9]
        assert all(s["copying"] for s in stats["all_sessions"])
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="not a rate in bytes per second"):
                a.copy_share(bad, 0)
    finally:
        a.close()
        b.close()


def test_copy_share_is_none_without_a_daemon(tmp_path):
    with pytest.warns(RuntimeWarning, match="keeping tensors in-process"):
        stash = actstash.connect(str(tmp_path / "nobody.sock"), on_unavailable="keep",
                                 connect_timeout=1.0)
    assert stash.copy_share() is None


def _step(model, idx, seed):
    from gpt import loss_fn
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss_fn(model, idx).backward()
    return cloned_grads(model)


def test_auto_plans_with_the_share_and_follows_it(share_daemon, caplog, monkeypatch):
    from gpt import GPT
    monkeypatch.setattr(_auto, "_SHARE_POLL_S", 0.0)  # ask at every step
    caplog.set_level("INFO", logger="actstash")
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=64, heads=2, layers=3, context=32)
    plain = copy.deepcopy(model)
    idx = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    stash = actstash.connect(share_daemon.socket)
    other = actstash.connect(share_daemon.socket)
    try:
        actstash.wrap(model, stash, policy="auto", budget="1GiB", min_bytes=0)
        before = stash.stats()["bytes_offloaded"]
        for k in range(2):
            assert bitwise_equal(_step(model, idx, k), _step(plain, idx, k)), k
        stash.synchronize()
        assert stash.stats()["bytes_offloaded"] > before  # the profile and probe stored
        # Copying alone, the probe is the measurement: the node figure does not apply.
        rates = stash.plan().copy_rates
        assert rates["share_bps"] == NODE_BPS and rates["copying_sessions"] == 1
        assert rates["probe_store_bps"] > NODE_BPS  # so a share would lower the rates
        assert rates["store_bps"] == rates["probe_store_bps"]
        assert rates["fetch_bps"] == rates["probe_fetch_bps"]
        assert "node copy share 0.04 GB/s configured, copying alone: the probe applies" in \
            str(stash.plan())
        # A second rank starts copying: the next step's plan counts on half.
        other.copy_share()
        for k in range(2, 5):
            assert bitwise_equal(_step(model, idx, k), _step(plain, idx, k)), k
        rates = stash.plan().copy_rates
        assert rates["copying_sessions"] == 2 and rates["store_bps"] == NODE_BPS / 2
        # CPU tensors come back as views of the daemon's memory: no copy to share.
        assert rates["fetch_bps"] == rates["probe_fetch_bps"]
        assert "re-planned (node copy share 0.02 GB/s: 0.04 GB/s configured over 2 copying " \
            "sessions, was 0.04 GB/s configured, copying alone" in caplog.text
        assert "node copy share 0.02 GB/s: 0.04 GB/s configured over 2 copying sessions" in \
            str(stash.plan())
        assert stash.plan().measured_peak is not None  # the re-plan was checked
        actstash.unwrap(model)
    finally:
        stash.close()
        other.close()


def test_a_share_above_the_probe_changes_nothing_but_the_report(monkeypatch):
    """A node figure far above what this machine copies: the other session's arrival is
    reported, the rates stay the probe's, and no re-plan happens."""
    from gpt import GPT
    monkeypatch.setattr(_auto, "_SHARE_POLL_S", 0.0)
    d = Daemon(extra=("--copy-bandwidth", "1000GB/s"))
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=64, heads=2, layers=3, context=32)
    idx = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    stash, other = actstash.connect(d.socket), actstash.connect(d.socket)
    try:
        actstash.wrap(model, stash, policy="auto", budget="1GiB", min_bytes=0)
        for k in range(2):
            _step(model, idx, k)
        planned = stash.plan()
        other.copy_share()
        for k in range(2, 4):
            _step(model, idx, k)
        rates = stash.plan().copy_rates
        assert rates["copying_sessions"] == 2 and rates["share_bps"] == 500e9
        assert rates["store_bps"] == rates["probe_store_bps"] == planned.copy_rates["store_bps"]
        assert stash.plan().settled  # no re-plan: nothing to check
        actstash.unwrap(model)
    finally:
        stash.close()
        other.close()
        d.stop()


def test_trainer_processes_on_one_daemon_each_plan_with_their_share(share_daemon):
    env = dict(os.environ, **PACKAGE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [env.get("PYTHONPATH"), EXAMPLES, TESTING_PYTHON]))
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "copy_share_run.py")
    trainers = [subprocess.Popen([sys.executable, child, share_daemon.socket, "2"], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
    try:
        lines = [p.stdout.readline() for p in trainers]  # each: what its plan counted on
    finally:
        ends = [p.communicate("go\n", timeout=600) for p in trainers]
    outs = []
    for p, line, (_, stderr) in zip(trainers, lines, ends):
        assert p.returncode == 0 and line, stderr
        outs.append(json.loads(line))
    for out in outs:
        assert out["bitwise"], out["table"]
        assert out["offloaded"] > 0  # its profile stored through the daemon
        rates = out["rates"]
        assert rates["copying_sessions"] == 2, out["table"]
        assert rates["share_bps"] == NODE_BPS / 2 and rates["store_bps"] == NODE_BPS / 2
        assert rates["fetch_bps"] == rates["probe_fetch_bps"]  # views: nothing copied
