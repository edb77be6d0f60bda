"""Supervisor: a small service manager speaking systemd's protocols, for tests
of actstashd's restart after a crash where systemd does not run.

It implements what actstashd uses of systemd (see server/restart/service_manager.h):
the notify socket ($NOTIFY_SOCKET; READY=1, FDSTORE=1 with FDNAME=,
FDSTOREREMOVE=1, MAINPID= and BARRIER=1, accepted from any process as with
NotifyAccess=all), the file-descriptor store (fds kept across restarts; one
that refers to a file already kept is dropped: systemd compares open file
descriptions, this compares inodes), and the
passing of the kept fds at the next start ($LISTEN_FDS from fd 3,
$LISTEN_FDNAMES, $LISTEN_PID). When the main process exits it is started
again (as Restart=always) until stop(); after a MAINPID= the process named
there is the main one (an upgrade in place: the one that sent it exits
without a restart).

    sup = Supervisor([actstashd, "--socket", path, ...], log=file)
    sup.start(); sup.wait_ready()
    sup.kill()              # SIGKILL: restarted with the kept fds
    sup.wait_ready(after=1) # the second start is ready
    sup.stop()
"""
import array
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

# The child side: put the passed fds at 3, 4, ... and exec with LISTEN_PID
# set to its own pid (which exec keeps).
_EXEC = r"""
import fcntl, os, sys
fds = [int(f) for f in os.environ.pop("ACTSTASH_SUPERVISOR_FDS", "").split(",") if f]
high = [fcntl.fcntl(f, fcntl.F_DUPFD, 4096) for f in fds]
for f in fds:
    os.close(f)
for i, f in enumerate(high):
    os.dup2(f, 3 + i, inheritable=True)
    os.close(f)
if fds:
    os.environ["LISTEN_FDS"] = str(len(fds))
    os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[1], sys.argv[1:])
"""


class Supervisor:
    def __init__(self, argv, log=None, env=None, restart_delay=0.05):
        self.argv = list(argv)
        self.log = log
        self.env = dict(os.environ if env is None else env)
        self.restart_delay = restart_delay
        self.address = "@actstash-supervisor-%d-%d" % (os.getpid(), id(self))
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + self.address[1:])
        self._sock.setblocking(False)
        self._lock = threading.Condition()
        self._receiving = threading.Lock()  # one reader of the socket at a time
        self._store = []  # [(name, fd)] in the order stored
        self._ready = 0  # READY=1 messages received
        self._starts = 0
        self._exits = []  # return codes, in order
        self._stopping = False
        self.proc = None
        self._main_pid = None  # the main process when a MAINPID= moved it off self.proc
        self.messages = []  # every notification's text, in order
        self._threads = []

    # The fd store -------------------------------------------------------
    def stored(self):
        """{name: [fd, ...]} of what the store keeps now."""
        with self._lock:
            out = {}
            for name, fd in self._store:
                out.setdefault(name, []).append(fd)
            return out

    def _keep(self, name, fds):
        for fd in fds:
            st = os.fstat(fd)
            if any((os.fstat(kept).st_dev, os.fstat(kept).st_ino) == (st.st_dev, st.st_ino)
                   for _, kept in self._store):
                os.close(fd)
                continue
            self._store.append((name, fd))

    def _remove(self, name):
        kept = []
        for entry in self._store:
            if entry[0] == name:
                os.close(entry[1])
            else:
                kept.append(entry)
        self._store = kept

    def _receive_one(self):
        """Handles one queued notification; False when none is queued (or closed)."""
        try:
            data, ancdata, _, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(253 * 4))
        except (socket.timeout, BlockingIOError, OSError):
            return False
        fds = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[:len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        with self._lock:
            self.messages.append(data.decode())
            if fields.get("FDSTORE") == "1":
                self._keep(fields.get("FDNAME", "stored"), fds)
                fds = []
            if fields.get("FDSTOREREMOVE") == "1":
                self._remove(fields.get("FDNAME", "stored"))
            if fields.get("READY") == "1":
                self._ready += 1
            if fields.get("MAINPID", "").isdigit():
                pid = int(fields["MAINPID"])
                self._main_pid = None if self.proc is not None and pid == self.proc.pid else pid
            if fields.get("BARRIER") == "1":
                for fd in fds:  # closed once everything before it is handled
                    os.close(fd)
                fds = []
            self._lock.notify_all()
        for fd in fds:  # fds sent with no FDSTORE=1
            os.close(fd)
        return True

    def _drain(self):
        """Handles every queued notification (what a dead process sent last
        is read before it is started again, as systemd does)."""
        with self._receiving:
            while self._receive_one():
                pass

    def _listen(self):
        while True:
            with self._lock:
                if self._stopping and (self.proc is None or self.proc.poll() is not None):
                    return
            if self._sock.fileno() < 0:
                return
            # Waits without the receive lock, so that _drain never waits on it.
            readable, _, _ = select.select([self._sock], [], [], 0.1)
            if readable:
                self._drain()

    # The process --------------------------------------------------------
    def _spawn(self):
        self._drain()
        env = dict(self.env)
        env["NOTIFY_SOCKET"] = self.address
        with self._lock:
            fds = [fd for _, fd in self._store]
            env["LISTEN_FDNAMES"] = ":".join(name for name, _ in self._store)
        env["ACTSTASH_SUPERVISOR_FDS"] = ",".join(str(fd) for fd in fds)
        for key in ("LISTEN_FDS", "LISTEN_PID"):
            env.pop(key, None)
        if not fds:
            env.pop("LISTEN_FDNAMES")
        proc = subprocess.Popen([sys.executable, "-c", _EXEC] + self.argv, env=env,
                                pass_fds=fds, stdout=self.log,
                                stderr=subprocess.STDOUT if self.log else None)
        with self._lock:
            self.proc = proc
            self._main_pid = None
            self._starts += 1
            self._lock.notify_all()

    @staticmethod
    def _wait_pid(pid):
        """Waits for a process that is not this one's child (a MAINPID)."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)

    def _watch(self):
        while True:
            with self._lock:
                proc = self.proc
            code = proc.wait()
            self._drain()  # a MAINPID= it sent before exiting
            with self._lock:
                main = self._main_pid
            if main is not None:
                self._wait_pid(main)  # it may have named another since
                self._drain()
                with self._lock:
                    if self._main_pid != main:
                        continue
                code = None  # not this supervisor's child: no exit code
            with self._lock:
                self._exits.append(code)
                self._lock.notify_all()
                if self._stopping:
                    return
            time.sleep(self.restart_delay)
            self._spawn()

    def start(self):
        self._spawn()
        for target in (self._listen, self._watch):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_ready(self, after=0, timeout=30):
        """Waits until more than `after` READY=1 notifications came (one per
        start that got ready); returns the count. TimeoutError otherwise."""
        deadline = time.time() + timeout
        with self._lock:
            while self._ready <= after:
                left = deadline - time.time()
                if left <= 0:
                    raise TimeoutError("actstashd sent no READY=1 within %s s" % timeout)
                self._lock.wait(left)
            return self._ready

    @property
    def ready_count(self):
        with self._lock:
            return self._ready

    @property
    def starts(self):
        with self._lock:
            return self._starts

    @property
    def exits(self):
        with self._lock:
            return list(self._exits)

    @property
    def main_pid(self):
        """The pid of the service's main process."""
        with self._lock:
            return self._main_pid if self._main_pid is not None else self.proc.pid

    def kill(self, sig=signal.SIGKILL):
        """Signals the main process (it is started again when it exits)."""
        os.kill(self.main_pid, sig)

    def corrupt(self, name, offset, data):
        """Writes `data` at `offset` into the kept fd called `name` (a memfd)."""
        fd = self.stored()[name][0]
        os.pwrite(fd, data, offset)

    def stop(self, timeout=30):
        """SIGTERM without a restart; then the store is emptied (as systemd
        does when a service stops). Returns the last exit code."""
        with self._lock:
            self._stopping = True
            proc = self.proc
            main = self._main_pid
        if main is not None:
            self._stop_pid(main, timeout)
        elif proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)
        with self._lock:
            for _, fd in self._store:
                os.close(fd)
            self._store = []
        self._sock.close()
        if main is not None:
            return self._main_code
        return proc.returncode if proc is not None else None

    def _stop_pid(self, pid, timeout):
        """SIGTERM to a main process that is not this one's child, whose exit
        code cannot be read: 0 when it exited within `timeout` (callers that
        care check its log), else it is killed and None."""
        self._main_code = None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            os.kill(pid, signal.SIGTERM)
            if select.select([fd], [], [], timeout)[0]:
                self._main_code = 0
            else:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)


class SupervisedDaemon:
    """actstashd under a Supervisor, on a socket in a fresh directory (mkdtemp),
    its output in actstashd.log there; started and ready on construction.

        binary  the actstashd to run
        pool, segment, extra  --pool-size, --segment-size, more flags
        env     its environment (None: this process's)
    """

    def __init__(self, binary, pool="512MiB", segment="4MiB", extra=(), prefix="actstash-crash-",
                 env=None):
        import tempfile
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.socket = os.path.join(self.dir, "actstash.sock")
        self.log_path = os.path.join(self.dir, "actstashd.log")
        self.log = open(self.log_path, "w")
        self.sup = Supervisor([binary, "--socket", self.socket, "--pool-size", pool,
                               "--segment-size", segment, "--exit-with-parent", *extra],
                              log=self.log, env=env)
        self.sup.start()
        self.sup.wait_ready()

    def text(self):
        """Everything the daemons wrote so far."""
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def crash(self):
        """SIGKILL; returns the seconds until the restarted daemon said READY=1."""
        ready = self.sup.ready_count
        start = time.perf_counter()
        self.sup.kill()
        self.sup.wait_ready(after=ready)
        return time.perf_counter() - start

    def upgrade(self, timeout=30):
        """SIGUSR2 to the main process (an upgrade in place, as `systemctl
        reload` sends it); returns once the successor said READY=1, the
        supervisor tracks it and the predecessor said it exits: the seconds
        the socket served no call (takeover_gap)."""
        from actstash_testing.daemon import takeover_gap
        old = self.sup.main_pid
        ready = self.sup.ready_count
        before = len(self.text())
        self.sup.kill(signal.SIGUSR2)
        self.sup.wait_ready(after=ready, timeout=timeout)
        deadline = time.time() + timeout
        while self.sup.main_pid == old or "handed over; exiting" not in self.text()[before:]:
            if time.time() > deadline:
                raise TimeoutError("no upgrade in place within %s s: %s" %
                                   (timeout, self.text()[before:]))
            time.sleep(0.01)
        return takeover_gap(self.text()[before:])

    def stop(self):
        """SIGTERM (no restart); the last exit code. The directory is removed."""
        import shutil
        code = self.sup.stop()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return code
