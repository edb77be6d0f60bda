"""The spill tier from a trainer's side: a GPT whose activations are several times the
daemon's pool (actstash_testing's spill_gpt, which bench/spill_step_bench.py times)
trains with stash.offload() against a daemon with --spill-dir; gradients are bitwise
those of plain autograd (with and without injected copy delays), and the bytes really
went to disk and came back (the daemon's and the client's counters)."""
import os
import subprocess
import sys

import pytest
import torch

import actstash
from actstash_testing.training import cloned_grads, spill_batch, spill_gpt
from conftest import Daemon, PACKAGE_ENV, ROOT, spilling_daemon
from gpt import GPT, loss_fn

# What this file tests does not depend on torch's version (conftest.py).
pytestmark = pytest.mark.torch_agnostic

torch.set_num_threads(1)
POOL = 64 << 20


@pytest.fixture(scope="module")
def spill_daemon():
    yield from spilling_daemon("64MiB", "4MiB", "actstash-spill-py-")


def _plain_grads(steps):
    model = spill_gpt(GPT)
    grads = []
    for step in range(steps):
        model.zero_grad()
        loss_fn(model, spill_batch(step)).backward()
        grads.append(cloned_grads(model))
    return grads


@pytest.mark.parametrize("delay_us", [0, 300], ids=["no-delay", "delay300us"])
def test_activations_three_times_the_pool_spill_and_train_bitwise(spill_daemon, delay_us):
    steps = 2
    expected = _plain_grads(steps)
    stash = actstash.connect(spill_daemon.socket, copy_delay_us=delay_us, seed=3)
    model = spill_gpt(GPT)
    offloaded = 0
    for step in range(steps):
        model.zero_grad()
        before = stash.stats()["bytes_offloaded"]
        with stash.offload(min_bytes=0):
            loss = loss_fn(model, spill_batch(step))
        offloaded = stash.stats()["bytes_offloaded"] - before
        loss.backward()
        for p, g in zip(model.parameters(), expected[step]):
            assert torch.equal(p.grad, g), f"step {step}: gradients differ"
    s = stash.stats()
    # The activations were over three times the pool; most of them went to disk and
    # came back, partly read back ahead of backward.
    assert offloaded >= 3 * POOL, offloaded
    assert s["bytes_spilled"] >= 2 * POOL, s
    assert s["bytes_restored"] >= POOL, s
    assert s["restores"] > 0 and s["restores_ahead"] > 0, s
    assert s["spilled_now_bytes"] == 0, s
    # The last stores of forward may still run when backward needs them (copies are
    # asynchronous): those come from their source (the exact bytes), the rest from
    # the daemon.
    assert s["tensors_fetched"] + s["unpacked_from_source"] == s["tensors_offloaded"], s
    assert s["tensors_fetched"] > s["tensors_offloaded"] // 2, s
    daemon = stash.client.stats()
    assert daemon["spill"]["on_disk_bytes"] == 0
    assert daemon["spill"]["checksum_failures"] == 0
    stash.close()


TRAINER = r'''
import sys, torch, actstash
sys.path.insert(0, sys.argv[2])
from gpt import GPT, loss_fn
torch.set_num_threads(1)
def model():
    torch.manual_seed(0)
    return GPT(vocab=256, dim=256, heads=4, layers=4, context=256, dropout=0.0)
batch = torch.randint(0, 256, (8, 257), generator=torch.Generator().manual_seed(5))
plain = model()
loss_fn(plain, batch).backward()
stash = actstash.connect(sys.argv[1], quota=32 << 20, copy_delay_us=100, seed=int(sys.argv[3]))
m = model()
for _ in range(2):
    m.zero_grad()
    with stash.offload(min_bytes=0):
        loss = loss_fn(m, batch)
    loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(m.parameters(), plain.parameters()))
s = stash.stats()
print("spilled", s["bytes_spilled"], "restored", s["bytes_restored"], flush=True)
'''


def test_two_trainers_sharing_a_small_pool_both_spill(spill_daemon):
    # Each trainer gets half the pool as its quota (as ranks of one node should:
    # ARCHITECTURE, "Spill tier"): each then spills against its own quota and
    # always makes progress.
    env = dict(os.environ, **PACKAGE_ENV)
    procs = [subprocess.Popen([sys.executable, "-c", TRAINER, spill_daemon.socket,
                               os.path.join(ROOT, "examples"), str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for seed in (1, 2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        words = out.split()
        assert int(words[words.index("spilled") + 1]) > 0, out
        assert int(words[words.index("restored") + 1]) > 0, out


def _spill_fds(pid, spill_dir):
    fd_dir = f"/proc/{pid}/fd"
    out = []
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith(spill_dir + "/"):
            out.append(os.path.join(fd_dir, name))
    return out


def test_corrupt_spill_file_is_an_error_in_the_trainer_and_the_daemon_goes_on(tmp_path):
    spill_dir = str(tmp_path)
    # Two sessions, each with half the pool as quota: the second trains whatever
    # the first (whose graph the exception may keep alive) still holds.
    d = Daemon(pool="128MiB", segment="4MiB", extra=("--spill-dir", spill_dir))
    try:
        stash = actstash.connect(d.socket, quota=64 << 20, seed=4)
        model = spill_gpt(GPT)
        with stash.offload(min_bytes=0):
            loss = loss_fn(model, spill_batch(0))
        fds = _spill_fds(d.proc.pid, spill_dir)
        assert fds, "forward at 3x the pool must have spilled"
        for path in fds:
            with open(path, "r+b") as f:
                f.seek(8192)
                f.write(b"bit rot" * 100)
                f.flush()
                os.fsync(f.fileno())
        # torch 2.x lets an unpack hook's StashError through as it is; 1.13 re-raises
        # it as a RuntimeError whose text starts with the type's name.
        with pytest.raises(RuntimeError, match="session .* failed its checksum") as raised:
            loss.backward()
        assert (isinstance(raised.value, actstash.StashError) or
                str(raised.value).startswith("StashError")), repr(raised.value)
        del loss
        stash.close()
        assert d.proc.poll() is None, "the daemon must keep serving"
        # A fresh trainer on the same daemon trains, spilling included.
        expected = _plain_grads(1)[0]
        again = actstash.connect(d.socket, quota=64 << 20, seed=5)
        model = spill_gpt(GPT)
        with again.offload(min_bytes=0):
            loss = loss_fn(model, spill_batch(0))
        loss.backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
        assert again.stats()["bytes_spilled"] > 0
        assert again.client.stats()["spill"]["checksum_failures"] >= 1
        again.close()
    finally:
        d.stop()


def _mlp_steps(socket, steps, layers=3):
    """`steps` steps of an MLP (48 MiB of activations each) through the pool: the
    time they took, and whether each step's gradients were plain autograd's."""
    import time
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                      torch.nn.Tanh()) for _ in range(layers)])
    import copy
    plain = copy.deepcopy(model)
    bitwise = []
    with actstash.connect(socket) as stash:
        start = time.perf_counter()
        for step in range(steps):
            x = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(10 + step))
            model.zero_grad()
            with stash.offload():
                loss = model(x).square().mean()
            loss.backward()
            plain.zero_grad()
            plain(x).square().mean().backward()
            bitwise.append(all(torch.equal(a.grad, b.grad)
                               for a, b in zip(model.parameters(), plain.parameters())))
        return time.perf_counter() - start, bitwise


def test_an_idle_holder_of_the_pool_gives_it_to_a_trainer_that_needs_it(tmp_path):
    """A trainer process stores 80 MiB of activations in a 96 MiB pool and sleeps
    holding them. A second trainer (no quota for either) then needs 48 MiB a step:
    it has nothing of its own to spill, and before the daemon asked sessions back it
    waited pool_wait (30 s) and failed. Now the holder, asked in the reply to its
    usage report, spills on its reporter's thread; the trainer trains bitwise within
    3x its time alone, and the holder resumes and finishes bitwise."""
    import json
    d = Daemon(pool="96MiB", segment="4MiB", extra=("--spill-dir", str(tmp_path)))
    try:
        alone, bitwise = _mlp_steps(d.socket, 4)
        assert all(bitwise)
        env = dict(os.environ, **PACKAGE_ENV)
        holder = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "python", "holder_run.py"), d.socket,
             "5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env)
        try:
            holding = json.loads(holder.stdout.readline())["holding"]
            assert holding >= 72 << 20, holding  # most of the pool
            beside, bitwise = _mlp_steps(d.socket, 4)
            assert all(bitwise)
            assert beside <= 3 * alone + 2.0, (beside, alone)  # + the first ask's report tick
            out, err = holder.communicate("go\n", timeout=300)
        finally:
            if holder.poll() is None:
                holder.kill()
        assert holder.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["bitwise"], result
        # It gave while it slept: asked, answered, spilled, and read it all back.
        assert result["reclaims_asked"] > 0 and result["reclaims_answered"] > 0, result
        assert result["reclaim_bytes_given"] > 0 and result["spilled"] > 0, result
        assert result["restored"] > 0, result
    finally:
        d.stop()


def test_reclaim_bench_quick(tmp_path):
    """bench/reclaim_bench.py's own code: the trainer beside a sleeping holder, bitwise,
    and the holder gave memory back."""
    from conftest import daemon_binary
    env = dict(os.environ, ACTSTASH_DAEMON_BINARY=daemon_binary(), **PACKAGE_ENV)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "reclaim_bench.py"),
                           "--quick", "--spill-dir", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every step bitwise: yes" in done.stdout, done.stdout
    given = float(done.stdout.split("the holder gave back")[1].split("MiB")[0])
    assert given > 0, done.stdout


def _start_holder(socket, layers=5):
    holder = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "python", "holder_run.py"), socket,
         str(layers)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ, **PACKAGE_ENV))
    import json
    line = holder.stdout.readline()
    assert line, holder.stderr.read()
    return holder, json.loads(line)["holding"]


def _wait_asked(socket, pid, timeout=30):
    """Waits until the daemon asked the session of process `pid` for memory back."""
    import time
    deadline = time.time() + timeout
    while time.time() < deadline:
        with actstash.connect(socket) as observer:
            sessions = observer.client.stats(all_sessions=True)["all_sessions"]
        if any(s["reclaims_asked"] for s in sessions if s["client_pid"] == pid):
            return True
        time.sleep(0.05)
    return False


def _wait_spill_dir_empty(daemon, spill_dir, timeout=15):
    import time
    deadline = time.time() + timeout
    while _spill_fds(daemon.proc.pid, spill_dir) and time.time() < deadline:
        time.sleep(0.05)
    return _spill_fds(daemon.proc.pid, spill_dir)


def test_a_holder_killed_while_it_gives_loses_nothing_of_the_waiter(tmp_path):
    """SIGKILL of the asked session while it spills for a waiting trainer: the trainer
    trains on bitwise (the dead session's memory and spill files go back), and nothing
    is left in the pool or on disk."""
    import signal
    import threading
    from conftest import wait_pool_empty
    d = Daemon(pool="96MiB", segment="4MiB", extra=("--spill-dir", str(tmp_path)))
    try:
        holder, holding = _start_holder(d.socket)
        assert holding >= 72 << 20
        result = {}
        trainer = threading.Thread(
            target=lambda: result.update(zip(("time", "bitwise"), _mlp_steps(d.socket, 3))))
        trainer.start()
        assert _wait_asked(d.socket, holder.pid)  # killed once asked (its first report)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        trainer.join(timeout=120)
        assert not trainer.is_alive() and all(result["bitwise"]), result
        assert wait_pool_empty(d.socket)["pool"]["used_bytes"] == 0
        assert _wait_spill_dir_empty(d, str(tmp_path)) == []
    finally:
        d.stop()


def test_a_waiter_killed_while_the_holder_gives_loses_nothing_of_the_holder(tmp_path):
    """SIGKILL of the asking session while the holder spills for it: the holder,
    resumed, finishes bitwise (what it spilled comes back), and nothing is left."""
    import json
    import signal
    from conftest import wait_pool_empty
    d = Daemon(pool="96MiB", segment="4MiB", extra=("--spill-dir", str(tmp_path)))
    try:
        holder, _ = _start_holder(d.socket)
        waiter = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "python", "holder_run.py"), d.socket,
             "5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=dict(os.environ, **PACKAGE_ENV))
        assert _wait_asked(d.socket, holder.pid)  # killed once the holder was asked for it
        waiter.send_signal(signal.SIGKILL)
        waiter.wait(timeout=30)
        out, err = holder.communicate("go\n", timeout=300)
        assert holder.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["bitwise"] and result["reclaims_asked"] > 0, result
        assert wait_pool_empty(d.socket)["pool"]["used_bytes"] == 0
        assert _wait_spill_dir_empty(d, str(tmp_path)) == []
    finally:
        d.stop()
