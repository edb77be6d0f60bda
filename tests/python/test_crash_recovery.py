"""actstashd killed (SIGKILL) while trainers offload, and started again by a
service manager that keeps its file descriptors (actstash_testing.supervisor:
systemd's notify and fd-store protocols). The restarted daemon maps the same
pool and takes the sessions, leases, spill files and inline objects from its
state table: every step completes bitwise (the quotas make blocks and objects
spill to disk), every offloaded tensor comes back, and the attached trainers
count the restarts as reattachments. A state table that fails its checksum is not
trusted: clients get the "state lost" error. Sessions that do not come back
within the grace period are closed and their leases freed."""
import os
import random
import re
import time

import pytest

from conftest import (PACKAGE_ENV, assert_trained_bitwise, daemon_binary, pool_stats,
                      wait_pool_empty)
from actstash_testing.supervisor import SupervisedDaemon
from actstash_testing.trainers import Trainers

# What this file tests does not depend on torch's version (conftest.py).
pytestmark = pytest.mark.torch_agnostic

# zero-copy, zero-copy under a quota that makes its blocks spill, inline
# objects under a quota that makes them spill
QUOTA = ("--quota", str(8 << 20))
KINDS = [(), QUOTA, ("--inline", *QUOTA)]
KILLS = int(os.environ.get("ACTSTASH_CRASH_KILLS", "4"))


def supervised(pool="512MiB", segment="4MiB", extra=(), env=None):
    return SupervisedDaemon(daemon_binary(), pool=pool, segment=segment, extra=extra, env=env)


def test_trainers_survive_daemon_crashes(tmp_path):
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    daemon = supervised(extra=("--spill-dir", str(spill_dir)))
    trainers = None
    try:
        trainers = Trainers(daemon.socket, len(KINDS), str(tmp_path),
                            env=dict(os.environ, **PACKAGE_ENV), each=KINDS)
        rng = random.Random(7)
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.2, 0.8))  # somewhere in a step
            daemon.crash()
        time.sleep(0.5)
        results = trainers.finish()
        assert_trained_bitwise(results)
        # Each restart was seen as one: the connection was made again.
        assert [r["inline"] for r in results] == [False, False, True], results
        assert all(r["reattaches"] == KILLS for r in results[:2]), results
        assert results[1]["spilled"] > 0, results
        assert results[2]["offloaded"] > 0 and results[2]["failures"] == 0, results
        text = daemon.text()
        assert text.count("recovery: the state of the daemon that crashed is back") == KILLS
        # Spilled blocks were on disk at some crash, and came back from there.
        files = [int(n) for n in re.findall(r"free segments reused, (\d+) spill files", text)]
        assert len(files) == KILLS and max(files) > 0, files
        # So were the inline trainer's objects, resident or spilled.
        objects = [int(n) for n in re.findall(r"spill files, (\d+) inline objects", text)]
        assert len(objects) == KILLS and max(objects) > 0, objects
        assert f"restart {KILLS} of this state" in text
        assert "not trusted" not in text
        stats = wait_pool_empty(daemon.socket)
        assert stats["sessions"] == 1, stats  # the check's own
        assert stats["pool"]["used_bytes"] == 0, stats
        assert stats["spill"]["files"] == 0 and stats["spill"]["on_disk_bytes"] == 0, stats
        assert not [n for n in daemon.sup.stored() if n.startswith("spill-")], daemon.sup.stored()
    finally:
        if trainers is not None:
            trainers.kill()
        assert daemon.stop() == 0


def _offload_and_hold(stash):
    """A forward pass whose saved tensors went to the daemon, kept for backward."""
    import torch
    import actstash
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    actstash.wrap(model, stash, mode="offload", min_bytes=0, blocks=torch.nn.Linear)
    loss = model(torch.randn(64, 256, requires_grad=True)).square().sum()
    assert stash.stats()["tensors_offloaded"] > 0
    return model, loss


def test_corrupted_state_is_not_trusted():
    import actstash
    daemon = supervised(pool="128MiB")
    try:
        stash = actstash.connect(daemon.socket, reattach_timeout_ms=20000)
        assert stash.client.attached
        model, loss = _offload_and_hold(stash)
        assert pool_stats(daemon.socket)["pool"]["used_bytes"] > 0
        # The format word, inside the header's checksummed part.
        daemon.sup.corrupt("state", 8, b"\x7f")
        daemon.crash()
        text = daemon.text()
        assert "is not trusted" in text and "fails its checksum" in text, text[-2000:]
        with pytest.raises(Exception) as error:
            loss.backward()
            for _ in range(20):  # what the engine defers surfaces at the next call
                stash.client.stats()
                time.sleep(0.1)
        message = str(error.value)
        assert "restarted without this session's state" in message or \
            "went away" in message, message
        with pytest.raises(actstash.StashError, match="unknown session token|went away"):
            stash.close()  # the session is gone
        # The restarted daemon serves afresh: nothing of the old state is held.
        stats = wait_pool_empty(daemon.socket)
        assert stats["pool"]["used_bytes"] == 0 and stats["sessions"] == 1, stats
    finally:
        assert daemon.stop() == 0


def test_sessions_that_do_not_come_back_are_closed_after_the_grace_period():
    import actstash
    daemon = supervised(pool="128MiB", extra=["--reattach-grace-seconds", "1"])
    try:
        # This client does not attach again: its recovered session must go.
        stash = actstash.connect(daemon.socket, reattach_timeout_ms=0)
        model, loss = _offload_and_hold(stash)
        held = pool_stats(daemon.socket)["pool"]["used_bytes"]
        assert held > 0
        daemon.crash()
        text = daemon.text()
        assert "1 sessions, " in text.split("recovery: the state of the daemon")[-1], text[-2000:]
        stats = wait_pool_empty(daemon.socket, timeout=20)
        assert stats["pool"]["used_bytes"] == 0, stats
        assert "did not attach again within 1 s" in daemon.text()
        with pytest.raises(Exception) as error:
            loss.backward()
        assert "went away" in str(error.value), str(error.value)
        with pytest.raises(actstash.StashError, match="unknown session token|went away"):
            stash.close()
    finally:
        assert daemon.stop() == 0


def test_a_store_too_small_for_the_pool_is_not_relied_on():
    import actstash
    # systemd says how many fds it keeps ($FDSTORE): 8 for 32 segments.
    daemon = supervised(pool="128MiB", env=dict(os.environ, FDSTORE="8"))
    try:
        assert "keeps at most 8 fds" in daemon.text()
        assert "sessions will not survive a crash" in daemon.text()
        stash = actstash.connect(daemon.socket)
        model, loss = _offload_and_hold(stash)
        daemon.crash()
        assert "recovery: the state of the daemon that crashed is back" not in daemon.text()
        # Not promised a recovery, the client gives the session up.
        with pytest.raises(Exception, match="went away|unknown session token"):
            for _ in range(50):
                stash.client.stats()
                time.sleep(0.05)
    finally:
        assert daemon.stop() == 0
