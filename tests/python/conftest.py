"""Fixtures: a real actstashd process per test module, on a private socket.

The package under test is the build tree's (build/python, put first on sys.path;
the daemon is build/server/actstashd) unless ACTSTASH_TEST_INSTALLED=1: then it is
the one installed in this interpreter's environment (pip install ./client/python),
and so is the daemon that ships inside it.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("ACTSTASH_BUILD_DIR", os.path.join(ROOT, "build"))
INSTALLED = os.environ.get("ACTSTASH_TEST_INSTALLED") == "1"
if not INSTALLED:
    sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
# What a subprocess that imports actstash needs in its environment.
PACKAGE_ENV = {} if INSTALLED else {"PYTHONPATH": os.path.join(BUILD, "python")}


def daemon_binary():
    if not INSTALLED:
        return os.path.join(BUILD, "server", "actstashd")
    from actstash import _daemon
    path = _daemon.binary("actstashd")
    assert path and path.startswith(os.path.dirname(_daemon.__file__)), path
    return path


class Daemon:
    def __init__(self, pool="1GiB", extra=(), segment="16MiB"):
        self.dir = tempfile.mkdtemp(prefix="actstash-py-")
        self.socket = os.path.join(self.dir, "actstash.sock")
        self.log = open(os.path.join(self.dir, "actstashd.log"), "w+")
        self.args = [daemon_binary(), "--socket", self.socket,
                     "--pool-size", pool, "--segment-size", segment, *extra]
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("actstashd exited: " + self.text())
            if os.path.exists(self.socket) and "] ready" in self.text():
                return
            time.sleep(0.02)
        raise RuntimeError("actstashd not ready: " + self.text())

    def text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self):
        self.kill(signal.SIGTERM)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


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
