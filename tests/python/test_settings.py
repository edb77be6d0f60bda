"""Settings across the C ABI: the native library describes its constants, defaults
and counters (the package reads them instead of re-declaring them), every client
setting is reachable from connect() by name and takes effect, bad settings are
ValueErrors that name the setting, and sizes are read by the daemon's one parser."""
import ctypes
import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.request

import pytest
import torch

import actstash
from actstash._connect import _daemon
from actstash._hooks import _stash
from actstash._native import lib as _lib
from actstash_testing.daemon import DaemonError
from conftest import Daemon, ROOT

C_API_H = os.path.join(ROOT, "client", "include", "actstash", "c_api.h")


def _header_defines():
    with open(C_API_H) as f:
        text = f.read()
    defines = {}
    for name, value in re.findall(r"^#define ACTSTASH_(\w+) +(0x[0-9A-F]+|\(1 << \d+\)|\d+)",
                                  text, re.M):
        defines[name.lower()] = eval(value)  # literal integers and (1 << n) only
    return defines


def test_the_description_is_the_headers():
    defines = _header_defines()
    d = _lib.DESCRIPTION
    assert d["c_api_version"] == defines["c_api_version"] == _lib._c.actstash_c_api_version()
    for name, value in d["pack_flags"].items():
        assert defines[name] == value, name
    for name, value in d["unpack_kinds"].items():
        assert defines["unpack_" + name] == value, name
    for reason in ("small", "parameter", "layout", "device", "no_copy_engine"):
        assert defines["keep_" + reason] == d["keep_reasons"].index(reason), reason
    assert defines["keep_listed"] == d["keep_reasons"].index("keep_listed")
    # The counters stats() shows are the described ones, one per reason kept.
    assert list(_lib.STAT_NAMES) == d["engine_stats"]
    assert [n[len("kept_"):] for n in d["engine_stats"] if n.startswith("kept_")] == \
        d["keep_reasons"]
    # The package's flag values are the described ones.
    assert _stash._FP32 == d["pack_flags"]["fp32"]
    assert _stash._KEEP_LAYOUT == (d["keep_reasons"].index("layout") + 1) << \
        d["pack_flags"]["keep_shift"]


def test_a_stash_runs_with_the_described_defaults_and_the_test_knob_rule():
    defaults = _lib.ENGINE_DEFAULTS
    assert defaults["inline_store_bytes"] == 1 << 20
    assert defaults["view_min_bytes"] == 32 << 10
    assert defaults["max_in_flight_bytes"] == 1 << 30
    stash = actstash.Stash(None, on_unavailable="keep")
    assert stash._inline_bytes == defaults["inline_store_bytes"]
    assert stash._view_min_bytes == defaults["view_min_bytes"]
    assert stash.max_in_flight_bytes == defaults["max_in_flight_bytes"]
    settings = _lib.engine_settings(stash._engine.ptr)
    assert settings == dict(defaults, on_failure="keep")
    # Injected copy delays send every CPU store through the copy engine: the engine,
    # not the package, applies that rule.
    delayed = actstash.Stash(None, on_unavailable="keep", copy_delay_us=5,
                             max_in_flight_bytes="512MiB")
    assert delayed._inline_bytes == 0
    assert delayed.max_in_flight_bytes == 512 << 20
    assert _lib.engine_settings(delayed._engine.ptr)["copy_delay_us"] == 5


def test_the_default_size_threshold_is_the_engines(daemon):
    # offload() and wrap() without min_bytes use the engine's default_min_bytes.
    threshold = _lib.DESCRIPTION["default_min_bytes"]
    assert threshold == _lib.DEFAULT_MIN_BYTES == 64 << 10
    stash = actstash.connect(daemon.socket)
    try:
        w = torch.randn(4, requires_grad=True)
        before = stash.stats()
        with stash.offload():
            below = (torch.ones(threshold // 4 - 1) * w[0]).sin()  # sin saves its input
            at = (torch.ones(threshold // 4) * w[1]).sin()
        after = stash.stats()
        assert after["kept_small"] - before["kept_small"] >= 1
        assert after["tensors_offloaded"] - before["tensors_offloaded"] >= 1
        assert after["bytes_offloaded"] - before["bytes_offloaded"] >= threshold
        (below.sum() + at.sum()).backward()
    finally:
        stash.close()


@pytest.mark.parametrize("settings,message", [
    ({"lease_retain": 5}, "unknown setting 'lease_retain' (settings: address, client_name,"),
    ({"spill": "no"}, "spill: expected true or false"),
    ({"rpc_timeout_ms": 1.5}, "rpc_timeout_ms: expected a whole number"),
    ({"lease_batch": 0}, "lease_batch: 0 is outside 1..4294967295"),
    ({"quota_bytes": "6 parsecs"}, "quota_bytes: unknown size unit in '6 parsecs'"),
    ({"quota_bytes": -1}, "quota_bytes: expected a number of bytes"),
    ({"cuda_device": -1}, "cuda_device: -1 is outside 0.."),
])
def test_bad_client_settings_name_the_setting(settings, message):
    with pytest.raises(ValueError) as error:
        _lib.Client(address="unix:///nonexistent/actstash.sock", **settings)
    assert str(error.value).startswith(message), str(error.value)


def test_bad_engine_settings_name_the_setting():
    for settings, message in (({"prefetch": -1}, "prefetch: -1 is outside 0..1024"),
                              ({"on_failure": "ignore"},
                               "on_failure: 'ignore' is not one of raise, keep"),
                              ({"inline_bytes": 0}, "unknown setting 'inline_bytes'")):
        handle = ctypes.c_void_p()
        code = _lib.engine_create(None, json.dumps(settings).encode(), None, ctypes.byref(handle))
        with pytest.raises(ValueError, match=re.escape(message)):
            _lib.raise_for(code)
        assert not handle.value
    for text in (b"[]", b"{", b'{"cpu_views": true'):
        code = _lib.engine_create(None, text, None, ctypes.byref(ctypes.c_void_p()))
        with pytest.raises(ValueError, match="options"):
            _lib.raise_for(code)


def test_sizes_are_the_daemons():
    assert _lib.parse_size("6GiB") == _lib.parse_size("6G") == 6 << 30
    assert _lib.parse_size("6GB") == 6_000_000_000
    assert _lib.parse_size("25%", 1000) == 250
    assert _lib.parse_size(4096) == 4096
    for bad in ("25%", "six", -1, True, "1.5 parsecs"):
        with pytest.raises(ValueError, match="^quota: "):
            _lib.parse_size(bad, what="quota")
    with pytest.raises(ValueError, match="^quota: not a byte size: 'lots'$"):
        actstash.connect("unix:///nonexistent/actstash.sock", quota="lots")


def test_connect_reaches_every_client_setting(daemon):
    # Every setting by name: connect's own arguments cover the first ones, the rest
    # pass through; a setting given twice is refused.
    own = {"address", "client_name", "quota_bytes", "rpc_timeout_ms", "connect_timeout_ms",
           "attach", "pin_leases", "cuda_device"}
    rest = {k: v for k, v in _lib.CLIENT_DEFAULTS.items() if k not in own}
    assert set(rest) >= {"spill", "restore_ahead", "pool_wait_ms", "lease_retain_ms",
                         "lease_batch", "tls_root_certs", "usage_report_interval_ms"}
    stash = actstash.connect(daemon.socket, quota="48MiB", **rest)
    assert stash.client.quota == 48 << 20  # a size string, read by the daemon's parser
    stash.close()
    with pytest.raises(TypeError, match="quota_bytes"):
        actstash.connect(daemon.socket, quota_bytes=1)


def _offload_chain(stash, steps=6, numel=4 << 20):
    """Saves `steps` tensors of numel floats (16 MiB each) and runs backward."""
    torch.manual_seed(0)
    x = torch.randn(numel, requires_grad=True)
    with stash.offload(min_bytes=0):
        h = x
        for _ in range(steps):
            h = torch.sin(h)
        loss = h.sum()
    loss.backward()
    return x.grad


def test_the_spill_setting_takes_effect():
    """spill=False (a ClientOptions setting only reachable by name) turns the spill tier
    off for this trainer: with activations over the pool, nothing is spilled and the
    stores that find no room are kept; with the default, they are spilled."""
    spill_dir = tempfile.mkdtemp(prefix="actstash-settings-")
    d = Daemon(pool="64MiB", segment="4MiB", extra=("--spill-dir", spill_dir))
    try:
        plain = _offload_chain(actstash.Stash(None, on_unavailable="keep"))
        spilling = actstash.connect(d.socket)
        assert torch.equal(_offload_chain(spilling), plain)
        s = spilling.stats()
        assert s["bytes_spilled"] > 0 and s["bytes_restored"] > 0, s
        spilling.close()

        with pytest.warns(RuntimeWarning):
            off = actstash.connect(d.socket, on_unavailable="keep", spill=False, pool_wait_ms=0)
            assert torch.equal(_offload_chain(off), plain)
        s = off.stats()
        assert s["bytes_offloaded"] > 0 and s["kept_failed"] > 0, s
        # The daemon's and the client's counts of this session: nothing went to disk.
        mine = off.client.stats()["self"]
        assert (mine["spill"] or {}).get("spilled_bytes", 0) == 0, mine
        assert off.client.zero_copy_usage()["spills"] == 0
        off.close()
    finally:
        d.stop()
        shutil.rmtree(spill_dir)


def test_the_numa_setting_places_the_pool():
    """--numa 0 binds the pool's pages to node 0 (every machine has one): the daemon's
    log says so and the kernel's view of its segments (/proc/PID/numa_maps) reads bind:0,
    every page on N0. A node the machine lacks stops the daemon at start, naming the
    nodes it has."""
    try:
        d = Daemon(pool="64MiB", segment="4MiB", extra=("--numa", "0"))
    except DaemonError as error:
        if "Operation not permitted" in str(error):  # seccomp (containers) forbids mbind
            pytest.skip(f"this kernel refuses NUMA bindings here: {error}")
        raise
    try:
        assert "the pool is bound to node 0 (--numa)" in d.text()
        with open(f"/proc/{d.proc.pid}/numa_maps") as f:
            segments = [line for line in f if "actstash-segment" in line]
        assert len(segments) == 16, segments
        assert all(" bind:0 " in line and " N0=" in line for line in segments), segments
    finally:
        d.stop()
    with pytest.raises(DaemonError, match="NUMA node 1000 is not one of this machine's"):
        Daemon(pool="64MiB", segment="4MiB", extra=("--numa", "1000"))


def _online_numa_nodes():
    try:
        with open("/sys/devices/system/node/online") as f:
            text = f.read().strip()
    except OSError:
        return []
    nodes = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        nodes.extend(range(int(first), int(last or first) + 1))
    return nodes


def test_a_split_pool_leases_from_the_callers_node():
    """--numa split splits the pool over the machine's nodes, one part bound to each (on a
    one-node machine: one part, on node 0), and a trainer leases from the part on the node
    it copies from: by default its CPU's, which it names in every lease. The session's
    stats show that node and the pool's stats each part; a lease the daemon could only
    give from another node's memory (numa_node= a node the pool has no part on) is counted
    as off the session's node. Gradients are plain autograd's either way."""
    nodes = _online_numa_nodes()
    if not nodes:
        pytest.skip("this kernel shows no NUMA nodes in sysfs")
    # 64 MiB per node: the trainer's part alone holds what it stores (32 MiB).
    try:
        d = Daemon(pool=f"{64 * len(nodes)}MiB", segment="4MiB",
                   extra=("--numa", "split", "--metrics-address", "127.0.0.1:0"))
    except DaemonError as error:
        if "Operation not permitted" in str(error):  # seccomp (containers) forbids mbind
            pytest.skip(f"this kernel refuses NUMA bindings here: {error}")
        raise
    try:
        assert "the pool is split over nodes" in d.text()
        plain = _offload_chain(actstash.Stash(None, on_unavailable="keep"), steps=2)
        local = actstash.connect(d.socket)
        assert torch.equal(_offload_chain(local, steps=2), plain)
        s = local.stats()
        assert s["bytes_offloaded"] >= 2 * (16 << 20), s
        assert s["numa_node"] in nodes and s["leases_off_node"] == 0, s
        if len(nodes) == 1:
            assert s["numa_node"] == nodes[0]
        parts = local.client.stats()["pool"]["numa_nodes"]
        assert [p["node"] for p in parts] == nodes, parts
        assert sum(p["total_bytes"] for p in parts) == (64 << 20) * len(nodes), parts
        local.close()
        # The same parts in `actstash stats` and in /metrics.
        cli = subprocess.run([_daemon.binary("actstash"), "-a", d.socket, "stats"],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        for p in parts:
            assert f"numa     node {p['node']}: " in cli.stdout, cli.stdout
        port = re.search(r"metrics on http://\S+ \(port (\d+)\)", d.text()).group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as page:
            metrics = page.read().decode()
        for p in parts:
            line = f'actstash_pool_numa_bytes{{node="{p["node"]}",state="total"}} '
            assert any(m.startswith(line) and float(m.split()[-1]) == p["total_bytes"]
                       for m in metrics.splitlines()), metrics

        far = actstash.connect(d.socket, numa_node=max(nodes) + 1)
        assert torch.equal(_offload_chain(far, steps=2), plain)
        s = far.stats()
        assert s["numa_node"] == max(nodes) + 1 and s["leases_off_node"] > 0, s
        far.close()
        with pytest.raises(ValueError, match="numa_node"):
            actstash.connect(d.socket, numa_node=1024)
    finally:
        d.stop()
