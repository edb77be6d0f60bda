"""The node's shared daemon: what connect() attaches to, or starts, when no node
daemon serves and no address was given (start="shared", the default).

One per user on a node, as ray.init() finds or starts the local instance: its
socket is in ACTSTASH_SHARED_DIR (default /tmp/actstash-shared-<uid>, mode 0700,
the socket 0600), the first process that finds none starts it under a lock
(the others wait on the lock, then attach to it), and it lives while any
trainer uses it: it shuts itself down once no session has been open for
UNUSED_SECONDS (actstashd --exit-when-unused-seconds). It is not the child of
any trainer (a new session, reparented at once), so the first rank's exit does
not stop it. Once it decides to exit it opens no session (UNAVAILABLE "shutting
down"), so a process that connects in that moment starts the next one, after the
old one has left the socket.
"""
import fcntl
import os
import socket as _socket
import stat
import subprocess
import time

from actstash._connect._daemon import binary
from actstash._errors import StashUnavailable

# How long the shared daemon outlives its last session (and waits for its first):
# $ACTSTASH_SHARED_UNUSED_SECONDS, default 30.
UNUSED_SECONDS = 30
_READY_TIMEOUT_S = 60.0
# How long a start waits for a daemon that refused (it is shutting down) to leave.
_LEAVE_TIMEOUT_S = 30.0


def shared_dir():
    return os.environ.get("ACTSTASH_SHARED_DIR") or f"/tmp/actstash-shared-{os.getuid()}"


def _own_dir(path):
    """The folder, made if missing; refused unless it is this user's alone (another
    user's folder could hold a socket that is not a daemon of ours)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError as error:
        raise StashUnavailable(f"the shared daemon's folder {path}: {error}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise StashUnavailable(
            f"the shared daemon's folder {path} is not a folder of this user with mode 0700: "
            "refusing to start or use a shared daemon there (remove it, or set "
            "ACTSTASH_SHARED_DIR)")
    return path


def connect_shared(open_client, daemon_args=()):
    """A client of the shared daemon (`open_client(address)` makes one), started first
    when none serves. StashUnavailable when it cannot be started."""
    folder = _own_dir(shared_dir())
    socket = os.path.join(folder, "actstash.sock")
    address = "unix://" + socket
    if os.path.exists(socket):
        try:
            return open_client(address)
        except StashUnavailable:
            pass  # gone, or going (its last session closed): start another, under the lock
    with open(os.path.join(folder, "start.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(socket):  # another process started it meanwhile
            try:
                return open_client(address)
            except StashUnavailable:
                _wait_gone(socket)  # one that is shutting down still listens
        _start(folder, socket, daemon_args)
        return open_client(address)


def _listening(path):
    """Whether a process listens on the Unix socket `path` (a file left by a daemon
    that was killed does not count: the next daemon replaces it)."""
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _wait_gone(path):
    deadline = time.monotonic() + _LEAVE_TIMEOUT_S
    while _listening(path):
        if time.monotonic() > deadline:
            raise StashUnavailable(
                f"the shared actstashd at {path} refuses sessions but did not exit within "
                f"{_LEAVE_TIMEOUT_S:.0f} s (its log: {os.path.dirname(path)}/actstashd.log)")
        time.sleep(0.02)


def _start(folder, socket, daemon_args):
    path = binary("actstashd")
    if path is None:
        raise StashUnavailable(
            "connect(): no actstashd to start as the node's shared daemon: the package was "
            "installed without its binaries and none is on PATH (set ACTSTASH_DAEMON to one)")
    log_path = os.path.join(folder, "actstashd.log")
    command = [path, "--socket", socket, "--socket-mode", "0600",
               "--exit-when-unused-seconds",
               os.environ.get("ACTSTASH_SHARED_UNUSED_SECONDS") or str(UNUSED_SECONDS),
               *[str(a) for a in daemon_args]]
    # Through sh, which exits at once: the daemon is nobody's child (init reaps it), and
    # in a session of its own (a terminal's Ctrl-C reaches the trainers, not it).
    subprocess.run(["/bin/sh", "-c", 'exec "$@" </dev/null >"$0" 2>&1 &', log_path, *command],
                   check=True, start_new_session=True)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        text = _read(log_path)
        if "] ready" in text and os.path.exists(socket):
            return
        if "cannot start" in text:
            raise StashUnavailable(f"the shared actstashd ({' '.join(command)}) did not start: "
                                   f"{text.strip()[-2000:]}")
        time.sleep(0.01)
    raise StashUnavailable(f"the shared actstashd was not ready within {_READY_TIMEOUT_S:.0f} s "
                           f"(its log: {log_path})")


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
