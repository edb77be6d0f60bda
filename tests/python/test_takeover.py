"""actstashd replaced while trainers offload (actstashd --take-over): trainer
processes attached to one daemon train a GPT with offloaded blocks while the
daemon is replaced several times. Every step completes with gradients bitwise
equal to plain autograd, every offloaded tensor comes back, the trainers saw
the gaps as pauses, and the last daemon holds nothing once they are gone."""
import json
import os
import subprocess
import sys
import time


from conftest import PACKAGE_ENV, Daemon

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINERS = 2
TAKE_OVERS = 4


def test_trainers_survive_repeated_take_overs(tmp_path):
    daemon = Daemon(pool="512MiB", segment="4MiB")
    procs = []
    try:
        env = dict(os.environ, **PACKAGE_ENV)
        stop = tmp_path / "stop"
        for i in range(TRAINERS):
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "takeover_run.py"), daemon.socket,
                 str(stop), str(tmp_path / f"ready{i}")],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.time() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(TRAINERS)):
            assert time.time() < deadline, "trainers did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        gaps = []
        for _ in range(TAKE_OVERS):
            time.sleep(0.5)  # some steps on this daemon
            gaps.append(daemon.take_over())
        time.sleep(0.5)
        stop.touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        for r in results:
            assert r["steps"] > 0 and r["not_bitwise"] == 0, r
            assert r["offloaded"] > 0 and r["fetched"] == r["offloaded"], r
            assert r["failures"] == 0, r
        # The gaps are seen: Lease/Return calls made while a daemon was replaced.
        assert sum(r["pauses"] for r in results) >= 1, results
        assert all(0 < gap < 10 for gap in gaps), gaps
        text = daemon.text()
        assert text.count("handed over; exiting") == TAKE_OVERS
        assert f"hand-over {TAKE_OVERS} of this state" in text
        # Nothing left behind: the trainers' sessions closed, their leases freed.
        import actstash
        check = actstash.connect(daemon.socket)
        deadline = time.time() + 10
        while True:  # returned leases are renewed (emptied) before they count as free
            stats = check.client.stats()
            if stats["pool"]["used_bytes"] == 0 or time.time() > deadline:
                break
            time.sleep(0.05)
        check.close()
        assert stats["sessions"] == 1, stats  # this check's own
        assert stats["pool"]["used_bytes"] == 0, stats
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        daemon.stop()
