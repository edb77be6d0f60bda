"""First touch off the hot path: a training step with the stash faults no more
pages into the trainer than plain autograd's (getrusage minor faults per
steady-state step), although it moves every saved activation through the
daemon's memory. The leases a step stores into stay mapped and populated from
one step to the next (lease retention, MADV_POPULATE_WRITE at lease time), and
fetches hand back views of them, so nothing is first-touched per step. A
first write to a fresh page costs 5-12 us on virtual machines: the cost this
keeps off the step. The training runs in first_touch_run.py, a child whose
glibc keeps freed memory (else its own heap's trims and regrowths fault
thousands of pages per step, variant or not, and hide the difference)."""
import json
import os
import statistics
import subprocess
import sys

import pytest

from conftest import PACKAGE_ENV

# What this file tests does not depend on torch's version (conftest.py).
pytestmark = pytest.mark.torch_agnostic

PAGE = os.sysconf("SC_PAGE_SIZE")
# glibc: fixed thresholds (no dynamic mmap threshold), no trimming, a padded heap.
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
              "MALLOC_TOP_PAD_": str(64 << 20)}


@pytest.mark.parametrize("mode", ["offload", "checkpoint+offload"])
def test_a_step_with_the_stash_faults_no_more_than_plain_autograd(daemon, mode):
    env = dict(os.environ, **KEEP_FREED, **PACKAGE_ENV)
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "first_touch_run.py")
    done = subprocess.run([sys.executable, child, daemon.socket, mode], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    steps = len(r["stash"])
    # The effect: every step stored and fetched through the daemon.
    assert r["offloaded"] > 0 and r["fetched"] > 0, r
    pages_moved = r["offloaded"] / steps / PAGE
    plain = max(statistics.median(r["plain"]), statistics.median(r["plain2"]))
    assert statistics.median(r["stash"]) <= plain, r
    if mode == "offload":
        # Had the stash's memory been first-touched per step, each step would fault
        # about once per page it moves (~3,800 here; checkpoint+offload moves only
        # the blocks' inputs, too few pages for this bound to tell).
        assert sum(r["stash"]) / steps < 0.05 * pages_moved, (r, pages_moved)
