"""connect() without a node daemon (start="shared", the default): the processes of one
node share one daemon, started by the first that finds none, and it exits once none
has used it for a while; start="never" (or ACTSTASH_START=never) keeps a missing node
daemon an error, and an explicit address names the one daemon to use."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import actstash
from actstash._native import lib
from conftest import PACKAGE_ENV

pytestmark = pytest.mark.skipif(
    os.path.exists(lib.DESCRIPTION["default_socket"]),
    reason="a node daemon serves at the default socket: connect() attaches to it")

UNUSED_S = 2  # the shared daemon's linger in these tests (ACTSTASH_SHARED_UNUSED_SECONDS)

# A trainer: connect() with no address, offload, say what it saw, and hold the session
# until told to close it.
TRAINER = """
import json, sys, torch, actstash
stash = actstash.connect(daemon_args=["--pool-size", "512MiB"])
x = torch.randn(256, 256, requires_grad=True)
with stash.offload(min_bytes=0):
    y = (x * x).sum()
y.backward()
stats = stash.stats()
print(json.dumps({"pid": stats["daemon_pid"], "offloaded": stats["bytes_offloaded"],
                  "address": stash.client.address, "bitwise": bool(torch.equal(x.grad, 2 * x))}),
      flush=True)
sys.stdin.readline()
stash.close()
"""


def _env(shared_dir, **extra):
    env = dict(os.environ, **PACKAGE_ENV, ACTSTASH_SHARED_DIR=str(shared_dir),
               ACTSTASH_SHARED_UNUSED_SECONDS=str(UNUSED_S), **extra)
    for name in ("ACTSTASH_ADDRESS", "ACTSTASH_START"):
        env.pop(name, None)
    return env


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_processes_of_a_node_share_one_daemon_started_for_them(tmp_path):
    shared = tmp_path / "shared"
    trainers = [subprocess.Popen([sys.executable, "-c", TRAINER], env=_env(shared),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    try:
        seen = [json.loads(t.stdout.readline()) for t in trainers]
    finally:
        for t in trainers:
            t.stdin.close()
    for t in trainers:
        assert t.wait(timeout=60) == 0
    pids = {s["pid"] for s in seen}
    assert len(pids) == 1, seen  # one daemon: one pool, one budget
    assert all(s["offloaded"] > 0 and s["bitwise"] for s in seen), seen
    assert all(s["address"].endswith(str(shared / "actstash.sock")) for s in seen), seen
    pid = pids.pop()
    # Nobody's child: it outlived the trainer that started it, and leaves by itself.
    deadline = time.monotonic() + UNUSED_S + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    log = (shared / "actstashd.log").read_text()
    assert not _alive(pid), log
    assert "no session for" in log and "shutting down" in log, log
    assert not (shared / "actstash.sock").exists()


def test_a_later_process_attaches_to_the_running_shared_daemon(tmp_path):
    shared = tmp_path / "shared"
    first = subprocess.Popen([sys.executable, "-c", TRAINER], env=_env(shared),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = json.loads(first.stdout.readline())["pid"]
        second = subprocess.run([sys.executable, "-c", TRAINER], env=_env(shared), input="\n",
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr
        assert json.loads(second.stdout)["pid"] == pid
        assert (shared / "actstashd.log").read_text().count("] ready") == 1  # started once
    finally:
        first.stdin.close()
        first.wait(timeout=60)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_strict_mode_keeps_a_missing_node_daemon_an_error(tmp_path, monkeypatch, how):
    monkeypatch.delenv("ACTSTASH_ADDRESS", raising=False)
    monkeypatch.setenv("ACTSTASH_SHARED_DIR", str(tmp_path / "shared"))
    if how == "environment":
        monkeypatch.setenv("ACTSTASH_START", "never")
    kwargs = {"start": "never"} if how == "argument" else {}
    with pytest.raises(actstash.StashUnavailable):
        actstash.connect(connect_timeout=1.0, **kwargs)
    assert not (tmp_path / "shared").exists()  # no daemon was started


def test_an_address_names_the_one_daemon_to_use(tmp_path, monkeypatch):
    monkeypatch.setenv("ACTSTASH_SHARED_DIR", str(tmp_path / "shared"))
    monkeypatch.delenv("ACTSTASH_START", raising=False)
    with pytest.raises(actstash.StashUnavailable):
        actstash.connect(str(tmp_path / "missing.sock"), connect_timeout=1.0)
    assert not (tmp_path / "shared").exists()
    with pytest.raises(ValueError, match="ACTSTASH_START"):
        monkeypatch.setenv("ACTSTASH_START", "sometimes")
        actstash.connect()


def test_a_shared_folder_that_is_not_this_users_alone_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    monkeypatch.delenv("ACTSTASH_ADDRESS", raising=False)
    monkeypatch.delenv("ACTSTASH_START", raising=False)
    monkeypatch.setenv("ACTSTASH_SHARED_DIR", str(shared))
    with pytest.raises(actstash.StashUnavailable, match="mode 0700"):
        actstash.connect()
    assert not (shared / "actstash.sock").exists()


def test_a_connect_in_the_moment_the_shared_daemon_exits_gets_a_working_session(
        tmp_path, monkeypatch):
    """Connects around the moment the shared daemon decides to exit (1 s after its last
    session; its reaper looks once a second): each gets a session that stays, from the
    old daemon or from the next one it starts. (A smoke test: the moment itself is a
    few milliseconds wide and seldom met here; session_manager_test proves the daemon
    refuses a session once it decided, and the test below that a start waits for it.)"""
    import random
    shared = tmp_path / "shared"
    for name, value in _env(shared).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ACTSTASH_SHARED_UNUSED_SECONDS", "1")
    for name in ("ACTSTASH_ADDRESS", "ACTSTASH_START"):
        monkeypatch.delenv(name, raising=False)
    rng = random.Random(7)
    pids = []
    for _ in range(8):
        with actstash.connect(daemon_args=["--pool-size", "64MiB"]) as stash:
            x = torch.randn(64, 64, requires_grad=True)  # 16 KiB: copied back, not viewed
            with stash.offload(min_bytes=0):
                y = (x * x).sum()
            time.sleep(0.3)  # the shutdown would close the session meanwhile
            y.backward()
            assert torch.equal(x.grad, 2 * x.detach())
            stats = stash.stats()
            assert stats["bytes_offloaded"] > 0 and stats["tensors_fetched"] > 0, stats
            pids.append(stats["daemon_pid"])
        time.sleep(rng.uniform(0.9, 2.3))
    assert len(set(pids)) > 1, pids  # some connects met a daemon that had left
    log = (shared / "actstashd.log").read_text()
    assert "shutting down" in log, log


def test_a_start_waits_for_a_shared_daemon_that_is_leaving(tmp_path, monkeypatch):
    """A daemon that refuses sessions (it decided to exit) still listens until it is
    gone: the process that wants a session waits for it to leave, then starts the next
    one, instead of starting one that finds the socket taken and fails."""
    import socket
    import threading
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    for name, value in _env(shared).items():
        monkeypatch.setenv(name, value)
    for name in ("ACTSTASH_ADDRESS", "ACTSTASH_START"):
        monkeypatch.delenv(name, raising=False)
    leaving = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # listens, answers nothing
    leaving.bind(str(shared / "actstash.sock"))
    leaving.listen(16)
    gone = threading.Timer(3.0, leaving.close)  # the socket file stays, as after a kill
    gone.start()
    try:
        started = time.monotonic()
        with actstash.connect(connect_timeout=0.5,
                              daemon_args=["--pool-size", "64MiB"]) as stash:
            x = torch.randn(64, 64, requires_grad=True)
            with stash.offload(min_bytes=0):
                y = (x * x).sum()
            y.backward()
            assert torch.equal(x.grad, 2 * x.detach())
            assert stash.stats()["bytes_offloaded"] > 0
            pid = stash.stats()["daemon_pid"]
        assert time.monotonic() - started >= 3.0  # it waited for the leaving one
    finally:
        gone.cancel()
        leaving.close()
    log = (shared / "actstashd.log").read_text()
    assert log.count("] ready") == 1 and "already listening" not in log, log
    assert _alive(pid)
