"""The actstash binaries that ship with the package, and a private daemon.

A node daemon (systemd unit, container, Kubernetes DaemonSet) is the default:
one pool and one budget for every trainer on the node. For one person on one
machine, `connect(start="auto")` starts a private actstashd from the package
when none answers; it lives as long as the process that started it (it exits
when that process exits, even on SIGKILL: actstashd --exit-with-parent).
"""
import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from actstash._errors import StashUnavailable

# The package's folder (this module is in a subpackage of it).
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# In a build tree the package is build/python/actstash and the binaries are
# build/server/actstashd and build/tools/actstash; installed, they are in bin/.
_BUILD_TREE = {"actstashd": ("server", "actstashd"), "actstash": ("tools", "actstash")}
_ENV = {"actstashd": "ACTSTASH_DAEMON", "actstash": "ACTSTASH_CLI"}
_MAX_SOCKET_PATH = 90  # the attach socket beside it must fit sockaddr_un (108 bytes)


def _is_native(path):
    """True for an executable ELF file (not a console-script wrapper, which would
    run this package again)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF" and os.access(path, os.X_OK)
    except OSError:
        return False


def binary(name):
    """The path of the native `actstashd` or `actstash` executable: $ACTSTASH_DAEMON /
    $ACTSTASH_CLI, else the one installed with the package, else the build tree's,
    else the first on PATH. None when there is none."""
    override = os.environ.get(_ENV[name])
    if override:
        return override
    candidates = [os.path.join(_HERE, "bin", name),
                  os.path.join(os.path.dirname(os.path.dirname(_HERE)), *_BUILD_TREE[name])]
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if directory:
            candidates.append(os.path.join(directory, name))
    for path in candidates:
        if _is_native(path):
            return path
    return None


_PREFIX = "actstash-private-"
_OWNER_FILE = "trainer.pid"


def _remove_orphans(base):
    """Removes the directories (log, owner file) that private daemons of killed
    trainers left behind: a SIGKILLed trainer runs no atexit handler, its daemon
    exits by itself but cannot remove the directory it runs in."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(_PREFIX)]
    except OSError:
        return
    for name in names:
        directory = os.path.join(base, name)
        try:
            if os.stat(directory).st_uid != os.getuid():
                continue
            with open(os.path.join(directory, _OWNER_FILE)) as f:
                owner = int(f.read())
            os.kill(owner, 0)  # raises when the trainer is gone
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
        except (OSError, ValueError):
            continue


class PrivateDaemon:
    """An actstashd child process on a socket in a private temporary directory
    (mode 0700, socket 0600), stopped by stop(), at interpreter exit, or by the
    daemon itself when this process dies."""

    def __init__(self, args=(), ready_timeout=60.0):
        path = binary("actstashd")
        if path is None:
            raise StashUnavailable(
                "connect(start=...): no actstashd to start: the package was installed without "
                "its binaries and none is on PATH (set ACTSTASH_DAEMON to one)")
        base = tempfile.gettempdir()
        if len(base) > _MAX_SOCKET_PATH - 40:
            base = "/tmp"
        _remove_orphans(base)
        self.dir = tempfile.mkdtemp(prefix=_PREFIX, dir=base)
        with open(os.path.join(self.dir, _OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        self.socket = os.path.join(self.dir, "actstash.sock")
        self.log_path = os.path.join(self.dir, "actstashd.log")
        command = [path, "--socket", self.socket, "--socket-mode", "0600", "--exit-with-parent",
                   *[str(a) for a in args]]
        with open(self.log_path, "wb") as log:
            # Its own session: a Ctrl-C in the terminal interrupts the trainer,
            # which may still need the daemon while it unwinds.
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                log_text = self.log()
                self._remove_dir()
                raise StashUnavailable(f"the private actstashd ({' '.join(command)}) exited with "
                                       f"code {code}: {log_text.strip()[-2000:]}")
            if os.path.exists(self.socket) and "] ready" in self.log():
                break
            if time.monotonic() > deadline:
                self.stop()
                raise StashUnavailable(f"the private actstashd was not ready within "
                                       f"{ready_timeout:.0f} s")
            time.sleep(0.01)
        atexit.register(self.stop)

    @property
    def address(self):
        return "unix://" + self.socket

    @property
    def pid(self):
        return self.proc.pid

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self, timeout=10.0):
        """SIGTERM, then SIGKILL after `timeout` seconds; removes the directory."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._remove_dir()

    def _remove_dir(self):
        shutil.rmtree(self.dir, ignore_errors=True)


_private = None
_private_lock = threading.Lock()


def private_daemon(args=()):
    """The process's private daemon, started on first use (one per process: the
    sessions of this process share its pool)."""
    global _private
    with _private_lock:
        if _private is None or _private.proc.poll() is not None:
            _private = PrivateDaemon(args)
        return _private
