"""DaemonProcess: a real actstashd child process on a private socket, for the
Python tests and benchmarks (testing/daemon_process.h is the C++ one)."""
import datetime
import os
import shutil
import signal
import subprocess
import tempfile
import time

READY_TIMEOUT_S = 30
STOP_TIMEOUT_S = 30


def takeover_gap(text):
    """Seconds between the first "take-over requested" line of `text` (an
    actstashd log) and the first "listening on" line after it: how long the
    socket served no call during that take-over."""
    lines = text.splitlines()
    asked = next(i for i, line in enumerate(lines) if "take-over requested" in line)
    served = next(line for line in lines[asked:] if "listening on" in line)

    def stamp(line):
        return datetime.datetime.strptime(line.split()[0], "%Y-%m-%dT%H:%M:%S.%f")
    return (stamp(served) - stamp(lines[asked])).total_seconds()


class DaemonError(RuntimeError):
    """actstashd exited while starting, or did not get ready in time; the
    message carries its log."""


class DaemonProcess:
    """actstashd on a socket in a fresh temporary directory (mkdtemp: mode
    0700), its output in actstashd.log there; ready when the socket exists and
    the log says "] ready". stop() ends it and removes the directory.

        binary     the actstashd to run
        pool       --pool-size
        segment    --segment-size (None: the daemon's default)
        extra      more actstashd flags, after those above
        log_level  --log-level (None: the daemon's default)
        prefix     of the temporary directory's name
    """

    def __init__(self, binary, pool, segment=None, extra=(), log_level=None,
                 prefix="actstash-"):
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.socket = os.path.join(self.dir, "actstash.sock")
        self.log_path = os.path.join(self.dir, "actstashd.log")
        self.log = open(self.log_path, "w+")
        # --exit-with-parent: a test or benchmark that dies (killed at a timeout) takes
        # its daemon with it rather than leaving it running beside the next ones.
        self.args = [binary, "--socket", self.socket, "--pool-size", pool, "--exit-with-parent"]
        if log_level:
            self.args += ["--log-level", log_level]
        if segment:
            self.args += ["--segment-size", segment]
        self.args += list(extra)
        self.proc = None
        self.start()

    def start(self):
        """Starts the process and waits until it is ready; on failure the
        directory is removed and DaemonError says why, with the log."""
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + READY_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._fail("actstashd exited: ")
            if os.path.exists(self.socket) and "] ready" in self.text():
                return
            time.sleep(0.02)
        self._fail(f"actstashd not ready after {READY_TIMEOUT_S} s: ")

    def _fail(self, what):
        text = self.text()
        DaemonProcess.stop(self)
        raise DaemonError(what + text)

    def text(self):
        """Everything the daemon wrote so far."""
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def warnings(self):
        """Log lines at level warn or above ("TIME LEVEL [PID] message")."""
        return [line for line in self.text().splitlines()
                if line.split()[1:2] and
                line.split()[1] in ("warn", "warning", "error", "critical")]

    def take_over(self):
        """Replaces the daemon with a successor started beside it (the same flags plus
        --take-over) and waits until the successor is ready and the old one exited 0;
        from then on this object is the successor (its log appended to the same file).
        Returns the gap in seconds between the old daemon's "take-over requested" and
        the successor's "listening on" log lines: how long the socket served no call.
        DaemonError (with both logs) when it does not happen."""
        old = self.proc
        before = len(self.text())
        successor = subprocess.Popen(self.args + ["--take-over"], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + READY_TIMEOUT_S
        while time.time() < deadline:
            if successor.poll() is not None:
                raise DaemonError("the successor exited: " + self.text()[before:])
            if old.poll() is not None and "] ready" in self.text()[before:]:
                break
            time.sleep(0.01)
        else:
            successor.kill()
            raise DaemonError("no take-over within %d s: %s" % (READY_TIMEOUT_S,
                                                                self.text()[before:]))
        if old.returncode != 0:
            raise DaemonError("the old daemon exited %d: %s" % (old.returncode, self.text()))
        self.proc = successor
        return takeover_gap(self.text()[before:])

    def kill(self, sig=signal.SIGKILL):
        """Sends `sig` if the process runs and waits (up to 30 s) for its exit;
        the directory stays (stop() removes it)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self):
        """SIGTERM, and SIGKILL if it has not exited 30 s later; then closes the
        log and removes the directory. Returns False when it took the SIGKILL
        (True when SIGTERM stopped it or it had exited already)."""
        clean = True
        try:
            self.kill(signal.SIGTERM)
        except subprocess.TimeoutExpired:
            clean = False
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return clean
