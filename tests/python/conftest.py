"""Fixtures: a real actstashd process per test module, on a private socket.

The package under test is the build tree's (build/python, put first on sys.path;
the daemon is build/server/actstashd) unless ACTSTASH_TEST_INSTALLED=1: then it is
the one installed in this interpreter's environment (pip install ./client/python),
and so is the daemon that ships inside it. The support shared with the benchmarks
(actstash_testing) comes from the source tree's testing/python.
"""
import os
import shutil
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "testing", "python"))
from actstash_testing.daemon import DaemonProcess  # noqa: E402
from actstash_testing.paths import (BUILD, BUILD_PYTHON, BUILT_DAEMON, EXAMPLES,  # noqa: E402,F401
                                    ROOT, TESTING_PYTHON)

INSTALLED = os.environ.get("ACTSTASH_TEST_INSTALLED") == "1"
if not INSTALLED:
    sys.path.insert(0, BUILD_PYTHON)
sys.path.insert(0, EXAMPLES)
# What a subprocess that imports actstash needs in its environment.
PACKAGE_ENV = {} if INSTALLED else {"PYTHONPATH": BUILD_PYTHON}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "torch_agnostic: what the test checks (the daemon's take-over, restart and spill "
        "tier, the package's layout) does not depend on torch's version, so CI runs it "
        "under one torch only (scripts/test's) and leaves it out of the lanes under "
        "pip's torch (`-m 'not torch_agnostic'`)")


def daemon_binary():
    if not INSTALLED:
        return BUILT_DAEMON
    import actstash
    from actstash._connect import _daemon
    path = _daemon.binary("actstashd")
    assert path and path.startswith(os.path.dirname(actstash.__file__)), path
    return path


class Daemon(DaemonProcess):
    """The daemon under test (daemon_binary()) with the tests' defaults."""

    def __init__(self, pool="1GiB", extra=(), segment="16MiB"):
        super().__init__(daemon_binary(), pool, segment=segment, extra=extra,
                         prefix="actstash-py-")

    def stop(self):
        assert super().stop(), "actstashd did not exit within 30 s of SIGTERM"


def spilling_daemon(pool, segment, prefix):
    """A Daemon with a spill tier in a fresh directory (a fixture's generator): after
    the module, the directory must be empty (spill files never have a name) and goes."""
    spill_dir = tempfile.mkdtemp(prefix=prefix)
    d = Daemon(pool=pool, segment=segment, extra=("--spill-dir", spill_dir))
    yield d
    d.stop()
    assert os.listdir(spill_dir) == []
    shutil.rmtree(spill_dir)


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon():
    d = Daemon(pool="256MiB")
    yield d
    d.stop()


@pytest.fixture(params=[0, 300], ids=["no-delay", "delay300us"])
def stash(request, daemon):
    """A stash on the module's daemon, without and with injected copy delays (every
    store then goes through the copy engine)."""
    import actstash  # the package under test, found through PYTHONPATH

    s = actstash.connect(daemon.socket, copy_delay_us=request.param, seed=7)
    assert s.client.attached
    yield s
    s.close()


def pool_stats(socket):
    """The daemon's stats, through a client of its own (counted in "sessions")."""
    import actstash
    check = actstash.connect(socket)
    try:
        return check.client.stats()
    finally:
        check.close()


def wait_pool_empty(socket, timeout=15):
    """The daemon's stats once its pool holds nothing, or after `timeout` s."""
    deadline = time.time() + timeout
    while True:  # returned leases are renewed (emptied) before they count as free
        stats = pool_stats(socket)
        if stats["pool"]["used_bytes"] == 0 or time.time() > deadline:
            return stats
        time.sleep(0.05)


def assert_trained_bitwise(results):
    """Trainer results (actstash_testing.trainers): steps ran, each bitwise equal to
    plain autograd, every offloaded tensor came back (read from the daemon, or from
    its source where backward needed it before its store had finished, as inline
    stores often do), no store failed."""
    for r in results:
        assert r["steps"] > 0 and r["not_bitwise"] == 0, r
        assert r["offloaded"] > 0 and r["fetched"] > 0, r
        assert r["fetched"] + r["from_source"] == r["offloaded"], r
        assert r["failures"] == 0, r
