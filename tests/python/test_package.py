"""The package as a user gets it: a private daemon started by connect(start=...),
which lives exactly as long as its trainer; the console entry points; the error
that says how to get a daemon. Under ACTSTASH_TEST_INSTALLED=1 this runs against
the pip-installed package and the binaries inside it."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import actstash
from actstash._connect import _daemon
from conftest import BUILD, INSTALLED, PACKAGE_ENV, ROOT

# What this file tests does not depend on torch's version (conftest.py).
pytestmark = pytest.mark.torch_agnostic


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_the_package_under_test_is_the_intended_one():
    package_dir = os.path.dirname(actstash.__file__)
    if INSTALLED:
        assert not package_dir.startswith(os.path.join(BUILD, "python")), package_dir
        for name in ("actstashd", "actstash"):
            path = _daemon.binary(name)
            assert path == os.path.join(package_dir, "bin", name), path
    else:
        assert package_dir == os.path.join(BUILD, "python", "actstash")


def test_unreachable_error_names_both_ways_once(tmp_path):
    missing = str(tmp_path / "nobody.sock")
    with pytest.raises(actstash.StashUnavailable) as error:
        actstash.connect(missing, connect_timeout=1.0)
    message = str(error.value)
    assert missing in message
    assert message.count("actstashd --socket") == 1, message
    assert message.count('start="auto"') == 1, message


def test_start_auto_prefers_a_running_daemon(daemon):
    stash = actstash.connect(daemon.socket, start="auto")
    try:
        assert stash.client.attached
        assert stash.client.address.endswith(daemon.socket)
    finally:
        stash.close()


def _offload_step(stash):
    torch.manual_seed(0)
    x = torch.randn(256, 1024, requires_grad=True)
    with stash.offload(min_bytes=0):
        y = (x * 3).sin().sum()
    y.backward()
    return x.grad


def test_start_auto_starts_a_private_daemon_that_offloads(tmp_path):
    missing = str(tmp_path / "nobody.sock")
    stash = actstash.connect(missing, start="auto", daemon_args=["--pool-size", "64MiB"])
    try:
        private = _daemon.private_daemon()
        assert stash.client.address == private.address
        assert os.stat(private.dir).st_mode & 0o777 == 0o700
        grad = _offload_step(stash)
        stats = stash.stats()
        assert stats["tensors_offloaded"] > 0 and stats["bytes_offloaded"] >= 256 * 1024 * 4
        torch.manual_seed(0)
        x = torch.randn(256, 1024, requires_grad=True)
        (x * 3).sin().sum().backward()
        assert torch.equal(grad, x.grad)
        # A second session of the process shares the same private daemon.
        other = actstash.connect(missing, start="always")
        assert other.client.address == private.address
        other.close()
    finally:
        stash.close()


def test_start_rejects_unknown_modes():
    with pytest.raises(ValueError, match="start must be one of"):
        actstash.connect(start="sometimes")


_TRAINER = textwrap.dedent("""
    import os, sys, time, torch, actstash
    from actstash._connect import _daemon
    stash = actstash.connect(sys.argv[1], start="auto", daemon_args=["--pool-size", "64MiB"])
    x = torch.randn(512, 512, requires_grad=True)
    with stash.offload(min_bytes=0):
        y = x.exp().sum()
    y.backward()
    private = _daemon.private_daemon()
    print(private.pid, private.dir, stash.stats()["tensors_offloaded"], flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)
""")


def _start_trainer(tmp_path, mode):
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    env = dict(os.environ, **PACKAGE_ENV)
    env.pop("ACTSTASH_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "nobody.sock"), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline().split()
    assert len(line) == 3, proc.stderr.read() if proc.poll() is not None else line
    pid, directory, offloaded = int(line[0]), line[1], int(line[2])
    assert offloaded > 0
    if mode == "hang":
        assert _pid_alive(pid)
    return proc, pid, directory


def test_private_daemon_stops_when_the_trainer_exits(tmp_path):
    proc, pid, directory = _start_trainer(tmp_path, "exit")
    assert proc.wait(timeout=60) == 0
    assert _wait_gone(pid, 5), "the private daemon outlived its trainer"
    assert not os.path.exists(directory)


def test_private_daemon_stops_when_the_trainer_is_killed(tmp_path):
    proc, pid, directory = _start_trainer(tmp_path, "hang")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert _wait_gone(pid, 2), "the private daemon outlived its SIGKILLed trainer"
    # The killed trainer could not remove its daemon's directory; the next private
    # daemon of this user does.
    assert os.path.isdir(directory)
    proc, _, _ = _start_trainer(tmp_path, "exit")
    assert proc.wait(timeout=60) == 0
    assert not os.path.exists(directory)


@pytest.mark.parametrize("name", ["actstashd", "actstash"])
def test_console_entry_points_run_the_native_binaries(name):
    env = dict(os.environ, **PACKAGE_ENV)
    code = f"import sys; sys.argv[0] = {name!r}; from actstash import _cli; _cli.{name}()"
    out = subprocess.run([sys.executable, "-c", code, "--version" if name == "actstashd" else
                          "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("0." in out.stdout) if name == "actstashd" else ("actstash" in out.stdout)
    if INSTALLED:
        # Wherever the installer put the script (a venv's bin beside its Python, or
        # /usr/local/bin for a system pip install): the one the distribution records.
        from importlib import metadata
        files = metadata.distribution("actstash").files or []
        scripts = [f.locate() for f in files  # not the package's own actstash/bin
                   if f.name == name and f.parent.name == "bin" and f.parts[0] == ".."]
        assert len(scripts) == 1, [str(f) for f in files]
        ran = subprocess.run([str(scripts[0]), "--version" if name == "actstashd" else "--help"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert ran.returncode == 0, ran.stderr
        assert ("0." in ran.stdout) if name == "actstashd" else ("actstash" in ran.stdout)


def _other_interpreters():
    """CPython 3.9+ interpreters on this machine other than the one running the
    tests (pyenv's, or python3.X in /usr/local/bin or /usr/bin), one per minor
    version."""
    found = {}
    roots = [os.path.expanduser("~/.pyenv/versions"), "/usr/local/bin", "/usr/bin"]
    for minor in range(9, 15):
        if minor == sys.version_info[1]:
            continue
        candidates = []
        if os.path.isdir(roots[0]):
            candidates += [os.path.join(roots[0], v, "bin", "python3")
                           for v in sorted(os.listdir(roots[0])) if v.startswith(f"3.{minor}.")]
        candidates += [os.path.join(root, f"python3.{minor}") for root in roots[1:]]
        for path in candidates:
            if os.access(path, os.X_OK):
                found[f"3.{minor}"] = path
                break
    return found


_OTHERS = _other_interpreters()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of ./client/python, built as pip builds it (offline)."""
    out = tmp_path_factory.mktemp("wheel")
    source = os.path.join(ROOT, "client", "python")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation",
                           "--no-index", "--no-deps", "-w", str(out), source],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, ACTSTASH_BUILD_DIR=BUILD))
    if proc.returncode != 0 and "No module named pip" in proc.stderr:
        pytest.skip("pip is not available to this interpreter")
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = list(out.glob("actstash-*.whl"))
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-linux_x86_64.whl"), wheels
    return wheels[0]


@pytest.mark.skipif(not _OTHERS, reason="no other CPython >= 3.9 on this machine")
@pytest.mark.parametrize("version", sorted(_OTHERS) or ["none"])
def test_the_wheel_serves_other_pythons_without_torch(version, wheel, tmp_path):
    """One wheel (py3-none) installs into a plain venv of another CPython: the
    package imports without torch, its library loads and answers, its commands
    run, and connect() says clearly that torch is missing."""
    venv = tmp_path / "venv"
    subprocess.run([_OTHERS[version], "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--root-user-action=ignore", str(wheel)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ACTSTASH_DAEMON")}
    probe = ("import actstash, actstash._native.lib as lib; "
             "assert lib._c.actstash_c_api_version() >= 1; "
             "print(actstash.StashUnavailable.__mro__[1].__name__)")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env,
                         timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "StashError"
    version_out = subprocess.run([str(venv / "bin" / "actstashd"), "--version"],
                                 capture_output=True, text=True, env=env, timeout=60)
    assert version_out.returncode == 0 and version_out.stdout.strip(), version_out.stderr
    no_torch = subprocess.run([python, "-c", "import actstash; actstash.connect()"],
                              capture_output=True, text=True, env=env, timeout=60,
                              cwd=str(tmp_path))
    assert no_torch.returncode != 0 and "torch" in no_torch.stderr, no_torch.stderr[-2000:]


@pytest.mark.skipif(not INSTALLED, reason="checks the installed package")
def test_installed_binaries_load_only_system_libraries_from_outside():
    """The wheel vendors what its native code loads beyond glibc and the GCC
    runtime (when built with patchelf, as scripts/setup installs it), so it runs
    in an image without gRPC, Protobuf or Abseil."""
    package = os.path.dirname(actstash.__file__)
    if not os.path.isdir(os.path.join(package, "lib")):
        pytest.skip("built without vendored libraries (ACTSTASH_VENDOR_LIBS=0 or no patchelf)")
    system = re.compile(r"^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libutil|"
                        r"libresolv|libgcc_s|libstdc\+\+)[-\w.]*\.so")
    for obj in ("libactstash.so", "bin/actstashd", "bin/actstash"):
        out = subprocess.run(["ldd", os.path.join(package, obj)], capture_output=True,
                             text=True, check=True).stdout
        for line in out.splitlines():
            name = line.split()[0]
            if system.match(name) or "=>" not in line:
                continue
            where = os.path.realpath(line.split("=>")[1].split()[0])
            assert where.startswith(os.path.realpath(package) + os.sep), (obj, line)
