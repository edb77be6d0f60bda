"""actstashd replaced while trainers offload (actstashd --take-over): trainer
processes attached to one daemon train a GPT with offloaded blocks while the
daemon is replaced several times. Every step completes with gradients bitwise
equal to plain autograd, every offloaded tensor comes back, the trainers saw
the gaps as pauses, and the last daemon holds nothing once they are gone."""
import os
import time


from conftest import PACKAGE_ENV, Daemon, assert_trained_bitwise, wait_pool_empty
from actstash_testing.trainers import Trainers

TRAINERS = 2
TAKE_OVERS = 4


def test_trainers_survive_repeated_take_overs(tmp_path):
    daemon = Daemon(pool="512MiB", segment="4MiB")
    trainers = None
    try:
        trainers = Trainers(daemon.socket, TRAINERS, str(tmp_path),
                            env=dict(os.environ, **PACKAGE_ENV))
        gaps = []
        for _ in range(TAKE_OVERS):
            time.sleep(0.5)  # some steps on this daemon
            gaps.append(daemon.take_over())
        time.sleep(0.5)
        results = trainers.finish()
        assert_trained_bitwise(results)
        # The gaps are seen: Lease/Return calls made while a daemon was replaced.
        assert sum(r["pauses"] for r in results) >= 1, results
        assert all(0 < gap < 10 for gap in gaps), gaps
        text = daemon.text()
        assert text.count("handed over; exiting") == TAKE_OVERS
        assert f"hand-over {TAKE_OVERS} of this state" in text
        # Nothing left behind: the trainers' sessions closed, their leases freed.
        stats = wait_pool_empty(daemon.socket, timeout=10)
        assert stats["sessions"] == 1, stats  # this check's own
        assert stats["pool"]["used_bytes"] == 0, stats
    finally:
        if trainers is not None:
            trainers.kill()
        daemon.stop()
