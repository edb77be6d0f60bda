"""connect(): a session with the node's actstashd (or a private one this process
starts, _daemon.py), wrapped in a Stash."""
from __future__ import annotations

import datetime
import math
import os
import threading
import warnings
from typing import Any, Iterable, Optional, Union

from actstash._errors import StashUnavailable
from actstash._hooks import Stash, current_cuda_device
from actstash._native import lib as _lib
from actstash._connect import _daemon, _shared

# Added to the native message, which already says how to start a node daemon.
_PRIVATE_DAEMON_HINT = ("Or let this process start a private one: "
                        "actstash.connect(start=\"auto\").")
_START_MODES = ("never", "shared", "auto", "always")


def _seconds(value: Union[float, datetime.timedelta], what: str) -> float:
    """A duration argument: seconds (int or float) or a datetime.timedelta, as
    torch.distributed takes its timeouts."""
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds or a "
                         f"datetime.timedelta, not {value!r}")
    return float(value)


def connect(address: Optional[str] = None, quota: Union[int, str, None] = None,
            on_unavailable: str = "raise", *, start: Optional[str] = None,
            daemon_args: Iterable[str] = (), name: Optional[str] = None, attach: str = "auto",
            timeout: Union[float, datetime.timedelta] = 30.0,
            connect_timeout: Union[float, datetime.timedelta] = 5.0, prefetch: int = 2,
            copy_delay_us: int = 0, seed: int = 0, pin: str = "auto", cuda: bool = True,
            device_pool: Optional[int] = None, downcast: Optional[str] = None,
            cpu_views: bool = True, max_in_flight_bytes: Union[int, str, None] = None,
            simulate_link_gbps: Optional[float] = None, **client_options: Any) -> Stash:
    """Opens a session with actstashd and returns a Stash.

    address: socket path, unix:///path or host:port; default ACTSTASH_ADDRESS, else the
      daemon's default socket. quota: bytes this trainer may hold (default: the daemon's).
    start: where the daemon comes from when none answers (default: $ACTSTASH_START, else
      "shared"). "shared": without an address, the node daemon, else the node's shared
      daemon, started by the first process that finds none: the processes of one node
      (DDP ranks) that call connect() share it, one pool and one budget, and it exits
      once none has used it for 30 s (one per user, in $ACTSTASH_SHARED_DIR, default
      /tmp/actstash-shared-UID); with an address, that daemon only. "never": the daemon at
      address (or the node's) must be running: StashUnavailable otherwise (strict, for
      operators: ACTSTASH_START=never). "auto": when no daemon answers at address, start
      a private actstashd from the package; "always": a private one regardless. A private
      daemon serves only this process, on a socket in a private temporary directory, and
      exits with it; it is started once per process and shared by its sessions.
      daemon_args: extra actstashd flags for a daemon this call starts, e.g.
      ["--pool-size", "8GiB"] (default pool: 25% of memory, at most 32 GiB).
    on_unavailable: "raise" (StashUnavailable, within connect_timeout) or "keep" (warn,
      and keep tensors in-process: training goes on without offload).
    Units: a duration whose name carries no unit is in seconds, or a datetime.timedelta
      (timeout: each call to the daemon; connect_timeout: reaching it); one whose name
      carries its unit is in that unit (copy_delay_us, and the native options' *_ms).
    copy_delay_us: test knob; every store of a CPU tensor then goes through the copy engine
      (none is copied on the packing thread), and each copy first sleeps up to this long.
    simulate_link_gbps: test knob, GB/s (10**9 bytes per second): a CPU run gets a GPU's
      link. Every store and fetch of a CPU tensor goes through the copy engine (none on the
      packing or unpacking thread, no views, fetches prefetched as for CUDA tensors) and
      takes at least bytes / the rate, queued per direction as on PCIe. It is this
      process's link: other processes on the node do not share it.
    pin: register leased memory with CUDA ("auto": when a GPU is present, falling back to
      unpinned memory with a warning; "on": required; "off").
    cuda: offload CUDA tensors (on a CUDA build with a device, when attached); False keeps
      them on the GPU.
    device_pool: a GPU ordinal of the daemon's device pool (actstashd --device-pool GPU:SIZE):
      CUDA tensors then go to that GPU's memory (peer to peer) instead of pinned host memory.
      Importing the pool maps all of it: for trainers that trust each other (same user).
    downcast: None (default: bytes come back exactly) or "bf16": dense fp32 activations are
      stored as bfloat16 (round to nearest even; NaN/Inf kept) and restored as fp32 — half
      the bytes, LOSSY: gradients then differ from plain autograd. Needs the zero-copy path.
    cpu_views: backward reads offloaded CPU tensors of 32 KiB and more in place in the
      daemon's shared memory (no copy back; smaller ones are copied back); False copies
      them all into fresh tensors.
    prefetch: how many CUDA tensors backward fetches ahead (in reverse save order).
    max_in_flight_bytes: a saved tensor's memory is held until its copy to the daemon is
      done; when the copies lag (a GPU faster than PCIe), forward waits (GIL released) for
      the oldest ones once this many bytes are in flight, so that memory is really given
      back. stats(): in_flight_bytes, peak_in_flight_bytes, in_flight_waits. 0: no bound;
      None: the engine's default (1 GiB). A size string ("512MiB") is read like the daemon's.
    client_options: any other setting of the native client by its name (the keys of
      actstash.client_defaults() that the arguments above do not cover), e.g.
      spill=False, restore_ahead=4, pool_wait_ms=0, lease_retain_ms=0, lease_batch=8,
      tls_root_certs=PEM. Sizes take bytes or a size string, durations milliseconds. An
      unknown name or a bad value is a ValueError naming it.
    """
    if downcast not in (None, "bf16"):
        raise ValueError("downcast must be None or 'bf16'")
    timeout = _seconds(timeout, "timeout")
    connect_timeout = _seconds(connect_timeout, "connect_timeout")
    if on_unavailable not in ("raise", "keep"):
        raise ValueError("on_unavailable must be 'raise' or 'keep'")
    if start is None:
        start = os.environ.get("ACTSTASH_START") or "shared"
    if start not in _START_MODES:
        raise ValueError(f"start must be one of {', '.join(_START_MODES)} (the argument or "
                         f"ACTSTASH_START), not {start!r}")
    address = address or os.environ.get("ACTSTASH_ADDRESS", "")
    if start == "shared" and address:
        start = "never"  # an address names the daemon to use: that one only

    for covered in ("client_name", "quota_bytes", "rpc_timeout_ms", "connect_timeout_ms",
                    "pin_leases", "cuda_device"):
        if covered in client_options:
            raise TypeError(f"connect(): {covered} is set through its own argument "
                            "(name, quota, timeout, connect_timeout, pin, device_pool)")

    def open_client(at):
        return _lib.Client(address=at, quota_bytes=_lib.parse_size(quota or 0, what="quota"),
                           client_name=name or f"torch-{os.getpid()}", attach=attach,
                           rpc_timeout_ms=max(1, round(timeout * 1000)),
                           connect_timeout_ms=max(1, round(connect_timeout * 1000)),
                           pin_leases=pin,
                           cuda_device=current_cuda_device() if device_pool is not None else 0,
                           **client_options)

    try:
        if start == "always":
            client = open_client(_start_private(daemon_args))
        else:
            try:
                if start == "shared" and not os.path.exists(_lib.DESCRIPTION["default_socket"]):
                    raise StashUnavailable("no node daemon")  # asking would take a second
                client = open_client(address)
            except StashUnavailable:
                if start == "shared":
                    client = _shared.connect_shared(open_client, daemon_args)
                elif start == "auto":
                    client = open_client(_start_private(daemon_args))
                else:
                    raise
    except StashUnavailable as error:
        if on_unavailable == "raise":
            hint = "" if start != "never" else " " + _PRIVATE_DAEMON_HINT
            raise StashUnavailable(f"{error}{hint}") from None
        warnings.warn(f"actstash: daemon unavailable ({error}); keeping tensors in-process",
                      RuntimeWarning, stacklevel=2)
        client = None
    if client is not None and device_pool is not None:
        pools = [p["device"] for p in client.device_pools()]
        if device_pool not in pools:
            client.close()
            raise ValueError(f"the daemon has no device pool on GPU {device_pool} (pools: "
                             f"{pools or 'none; start actstashd with --device-pool GPU:SIZE '}"
                             f"{'' if pools else '--allow-uid UID'})")
    return Stash(client, on_unavailable=on_unavailable, prefetch=prefetch, cuda=cuda,
                 device_pool=device_pool, downcast=downcast, copy_delay_us=copy_delay_us,
                 seed=seed, cpu_views=cpu_views, max_in_flight_bytes=max_in_flight_bytes,
                 simulate_link_gbps=simulate_link_gbps)


def _start_private(daemon_args):
    world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    if world > 1:
        warnings.warn("actstash: each rank starts its own private actstashd (start=...), each "
                      "with its own pool; run one node daemon for all ranks to share one pool "
                      "and budget", RuntimeWarning, stacklevel=3)
    return _daemon.private_daemon(daemon_args).address


_process_stash = None
_process_lock = threading.Lock()


def process_stash() -> Stash:
    """The process's own Stash, connect() with its defaults on first use: what an
    OffloadAdamW made without a stash= uses. Made again if it was closed."""
    global _process_stash
    with _process_lock:
        if _process_stash is None or _process_stash.client is None or \
                _process_stash.client.closed:
            _process_stash = connect()
        return _process_stash
