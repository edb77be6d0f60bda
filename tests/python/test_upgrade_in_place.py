"""Upgrade in place under a service manager: SIGUSR2 (what `systemctl reload
actstashd` sends) makes the serving daemon start its own successor, which
takes the pool, the sessions and their attach connections over; the manager
is told that the successor is the main process now (MAINPID=) before the
predecessor exits. The successor goes on with a copy of its predecessor's
state table and keeps it in the manager's fd store, so that a crash after
the upgrade still finds everything stored since: trainers offload through
upgrades and SIGKILLs in turn, every step completes bitwise, and each crash
is a reattachment while each upgrade is not. A daemon that kept no table (it
ran without a service manager) taken over by one under a manager: the
successor keeps a new table, filled from what it took over, from then on."""
import os
import random
import re
import time

import pytest

from conftest import (PACKAGE_ENV, Daemon, assert_trained_bitwise, daemon_binary,
                      wait_pool_empty)
from actstash_testing.supervisor import SupervisedDaemon, Supervisor
from actstash_testing.trainers import Trainers

# What this file tests does not depend on torch's version (conftest.py).
pytestmark = pytest.mark.torch_agnostic

# zero-copy, zero-copy under a quota that makes its blocks spill, inline
# objects under a quota that makes them spill
QUOTA = ("--quota", str(8 << 20))
KINDS = [(), QUOTA, ("--inline", *QUOTA)]
ROUNDS = int(os.environ.get("ACTSTASH_UPGRADE_ROUNDS", "2"))


def test_trainers_survive_upgrades_in_place_and_crashes_after_them(tmp_path):
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    daemon = SupervisedDaemon(daemon_binary(), extra=("--spill-dir", str(spill_dir)))
    trainers = None
    try:
        trainers = Trainers(daemon.socket, len(KINDS), str(tmp_path),
                            env=dict(os.environ, **PACKAGE_ENV), each=KINDS)
        rng = random.Random(11)
        pids = [daemon.sup.main_pid]
        for _ in range(ROUNDS):
            time.sleep(rng.uniform(0.2, 0.8))  # somewhere in a step
            assert 0 < daemon.upgrade() < 10
            pids.append(daemon.sup.main_pid)
            # What is stored from here on is in the successor's table only.
            time.sleep(rng.uniform(0.3, 0.8))
            daemon.crash()
            pids.append(daemon.sup.main_pid)
        time.sleep(0.5)
        results = trainers.finish()
        assert_trained_bitwise(results)
        assert len(set(pids)) == len(pids), pids
        # The crashes were reattachments; the upgrades kept the connections.
        assert all(r["reattaches"] == ROUNDS for r in results[:2]), results
        assert results[1]["spilled"] > 0, results
        assert results[2]["offloaded"] > 0 and results[2]["failures"] == 0, results
        text = daemon.text()
        assert text.count("SIGUSR2: started the successor") == ROUNDS, text[-4000:]
        assert text.count("the service manager tracks pid") == ROUNDS, text[-4000:]
        assert text.count("recovery: the state of the daemon that crashed is back") == ROUNDS
        # The successors went on with copies (which are not restarts).
        assert "keeps a new one" not in text, text[-4000:]
        assert f"restart {ROUNDS} of this state" in text
        assert "not trusted" not in text and " lost:" not in text, text[-4000:]
        objects = [int(n) for n in re.findall(r"spill files, (\d+) inline objects", text)]
        assert len(objects) == ROUNDS and max(objects) > 0, objects
        stats = wait_pool_empty(daemon.socket)
        assert stats["sessions"] == 1, stats  # the check's own
        assert stats["pool"]["used_bytes"] == 0, stats
        assert stats["spill"]["files"] == 0 and stats["spill"]["on_disk_bytes"] == 0, stats
        stored = daemon.sup.stored()
        assert not [n for n in stored if n.startswith("spill-")], stored
        assert len(stored["state"]) == 1, stored
    finally:
        if trainers is not None:
            trainers.kill()
        assert daemon.stop() == 0


def _forward(stash):
    """A forward pass of six layers (offloaded when `stash` is given)."""
    import torch
    import actstash
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    if stash is not None:
        actstash.wrap(model, stash, mode="offload", min_bytes=0, blocks=torch.nn.Linear)
    return model, model(torch.randn(64, 256)).square().sum()


def test_a_daemon_without_a_manager_taken_over_under_one_is_kept_from_then_on(tmp_path):
    """The successor's fresh table holds what it adopted: an inline client's
    objects, resident and spilled, come back after the successor crashes.
    (Clients attached to the first daemon were told it keeps nothing, and
    give their sessions up when their connection ends: this one has none.)"""
    import actstash
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    plain = Daemon(pool="256MiB", segment="4MiB", extra=("--spill-dir", str(spill_dir)))
    sup = None
    try:
        reference, loss = _forward(None)
        loss.backward()
        stash = actstash.connect(plain.socket, quota="256KiB", attach="off")
        model, loss = _forward(stash)
        assert stash.stats()["tensors_offloaded"] >= 6, stash.stats()
        sup = Supervisor(plain.args + ["--take-over"], log=plain.log)
        sup.start()
        sup.wait_ready()
        assert plain.proc.wait(timeout=30) == 0
        sup.kill()
        sup.wait_ready(after=1)
        loss.backward()
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert mine.grad.equal(theirs.grad)
        text = plain.text()
        assert "the serving daemon kept no state table" in text, text[-4000:]
        # Its command line says --take-over: after the crash it recovers instead.
        assert "passed kept fds: recovering from them" in text, text[-4000:]
        handed = re.findall(r"took over 1 sessions, 0 leases, (\d+) inline objects and (\d+) "
                            r"spill files", text)
        back = re.findall(r"crashed is back \(restart 1 of this state\): 1 sessions, .* (\d+) "
                          r"spill files, (\d+) inline objects", text)
        assert len(handed) == 1 and len(back) == 1, text[-4000:]
        # Every object came back, spilled ones too.
        assert int(handed[0][1]) > 0 and handed[0][::-1] == back[0], (handed, back)
        assert "not trusted" not in text and " lost:" not in text, text[-4000:]
        stash.close()
    finally:
        if sup is not None:
            assert sup.stop() == 0
        plain.stop()
