"""actstashd replaced while trainers offload (actstashd --take-over): trainer
processes on one daemon with a spill tier train a GPT with offloaded blocks while
the daemon is replaced several times: zero-copy and inline stores, each with and
without a quota that makes their data spill (blocks by the client, objects by the
daemon). Every step completes with gradients bitwise equal to plain autograd,
every offloaded tensor comes back, the trainers saw the gaps as pauses, and the
last daemon holds nothing, in the pool or on disk, once they are gone."""
import os
import re
import time

import pytest

from conftest import PACKAGE_ENV, Daemon, assert_trained_bitwise, wait_pool_empty
from actstash_testing.trainers import Trainers

# What this file tests does not depend on torch's version (conftest.py).
pytestmark = pytest.mark.torch_agnostic

QUOTA = ("--quota", str(8 << 20))
# zero-copy, zero-copy spilling, inline, inline spilling
KINDS = [(), QUOTA, ("--inline",), ("--inline", *QUOTA)]
TAKE_OVERS = 4


def test_trainers_survive_repeated_take_overs(tmp_path):
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    daemon = Daemon(pool="512MiB", segment="4MiB", extra=("--spill-dir", str(spill_dir)))
    trainers = None
    try:
        trainers = Trainers(daemon.socket, len(KINDS), str(tmp_path),
                            env=dict(os.environ, **PACKAGE_ENV), each=KINDS)
        gaps = []
        for _ in range(TAKE_OVERS):
            time.sleep(0.5)  # some steps on this daemon
            gaps.append(daemon.take_over())
        time.sleep(0.5)
        results = trainers.finish()
        assert_trained_bitwise(results)
        # What was handed over: inline objects and spill files, spilled by both paths.
        assert [r["inline"] for r in results] == [False, False, True, True], results
        assert results[1]["spilled"] > 0 and results[3]["spilled"] > 0, results
        handed = [tuple(map(int, m)) for m in re.findall(
            r"took over \d+ sessions, \d+ leases, (\d+) inline objects and (\d+) spill files",
            daemon.text())]
        assert len(handed) == TAKE_OVERS, handed
        assert max(objects for objects, _ in handed) > 0, handed
        assert max(files for _, files in handed) > 0, handed
        # The gaps are seen: Lease/Return calls made while a daemon was replaced.
        assert sum(r["pauses"] for r in results) >= 1, results
        assert all(0 < gap < 10 for gap in gaps), gaps
        text = daemon.text()
        assert text.count("handed over; exiting") == TAKE_OVERS
        assert f"hand-over {TAKE_OVERS} of this state" in text
        # Nothing left behind: the trainers' sessions closed, their leases, objects
        # and spill files freed.
        stats = wait_pool_empty(daemon.socket, timeout=10)
        assert stats["sessions"] == 1, stats  # this check's own
        assert stats["pool"]["used_bytes"] == 0, stats
        assert stats["objects"] == 0, stats
        assert stats["spill"]["files"] == 0 and stats["spill"]["on_disk_bytes"] == 0, stats
    finally:
        if trainers is not None:
            trainers.kill()
        daemon.stop()
