"""Stash: a session with actstashd plus the saved-tensor hooks that use it.

The hooks are a thin adapter: they read what only torch knows (a tensor's
address, size, layout, device, stream and version), allocate the tensors
torch needs, and hand the rest to the native saved-tensor engine
(actstash/saved_tensors.h): the offload decision, the stores and what they
hold in flight, prefetch, fetches, releases, the version check, the failure
policy and the counters.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import threading
import warnings
import weakref
from typing import Any, ContextManager, Dict, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from actstash._errors import StashError, StashInvalidArgument
from actstash._native import lib as _lib

# The engine's constants, as the native library describes them (c_api.h).
_FLAGS = _lib.DESCRIPTION["pack_flags"]
_FP32, _DENSE, _SYNC = _FLAGS["fp32"], _FLAGS["dense"], _FLAGS["sync"]
_KEEP_SHIFT, _NDIM_SHIFT, _DEVICE_SHIFT = (
    _FLAGS["keep_shift"], _FLAGS["ndim_shift"], _FLAGS["device_shift"])
_KEEP_REASONS = _lib.DESCRIPTION["keep_reasons"]


def _keep(reason):
    return (_KEEP_REASONS.index(reason) + 1) << _KEEP_SHIFT


_KEEP_SMALL, _KEEP_PARAMETER, _KEEP_LISTED, _KEEP_LAYOUT, _KEEP_DEVICE = (
    _keep(r) for r in ("small", "parameter", "keep_listed", "layout", "device"))
_KINDS = _lib.DESCRIPTION["unpack_kinds"]
_SOURCE, _VIEW, _DESTINATION, _PREFETCHED, _COPIED = (
    _KINDS[k] for k in ("source", "view", "destination", "prefetched", "copied"))
_UNKNOWN_VERSION = (1 << 64) - 1


def current_cuda_device():
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def storage_address(t):
    """Where t's storage begins: identifies what t aliases without holding it."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def storage(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def storage_ref(t):
    """A weak reference to t's storage (not to the tensor object, which may be a
    temporary alias such as w.t() or w.detach())."""
    return StorageWeakRef(storage(t))


def aliases_parameter(t):
    """A parameter (its module holds it anyway), or a view of one (e.g. weight.t()).
    A leaf that requires grad but is no nn.Parameter is an activation (a pipeline
    stage's received input, a trainer's input): it is offloaded like any other."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def kept_layout(t):
    """A tensor whose bytes do not say what it is, kept where it is (as the libtorch
    adapter keeps it): not strided, more dimensions than the engine gathers, a lazy
    conjugate or negative bit (its bytes are its base's), quantized, nested, or
    elements that overlap other than by broadcasting (an as_strided overlap)."""
    return (t.layout != torch.strided or t.dim() > 8 or t.is_conj() or t.is_neg()
            or t.is_quantized or t.is_nested or (not t.is_contiguous() and _overlapping(t)))


def _overlapping(t):
    """Elements that overlap apart from broadcast (stride 0) dimensions: the libtorch
    adapter's DistinctButForBroadcasts, negated."""
    span = 1
    for st, sz in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1 and st):
        if st < span:
            return True
        span = st * sz
    return False


def _is_dense(t):
    """True when t's elements fill one span of t.numel() elements exactly (any
    dimension order): its bytes can be copied raw and restored with the same strides."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


class _Engine:
    """Owns the native engine handle; freed when the last saved tensor and the Stash
    that use it are gone, or at interpreter exit, whichever comes first."""

    __slots__ = ("ptr", "__weakref__")

    def __init__(self, ptr):
        self.ptr = ptr
        _LIVE_ENGINES.add(self)

    def free(self):
        """Waits for the engine's copies, drops what it holds and frees it (once)."""
        ptr, self.ptr = self.ptr, None
        if ptr:
            try:
                _lib.engine_free(ptr)
            except Exception:  # interpreter shutdown
                pass

    def __del__(self):
        self.free()


# Engines not yet freed. At exit they are freed by an atexit handler, while the
# interpreter (owners are Python objects) and the CUDA runtime (statically linked:
# torn down by the C library's exit handlers, after Python's) still work; left to
# garbage collection during finalization, or never collected at all, their copy
# threads could outlive both.
_LIVE_ENGINES: "weakref.WeakSet[_Engine]" = weakref.WeakSet()


@atexit.register
def _free_engines_at_exit():
    for engine in list(_LIVE_ENGINES):
        engine.free()


class _Saved:
    """One offloaded saved tensor, as autograd holds it. Dropping it (graph freed)
    tells the engine, which frees the daemon's copy once no copy or view uses it."""

    __slots__ = ("id", "engine", "dtype", "shape", "stride", "device", "dense", "ref", "base",
                 "nbytes", "__weakref__")

    def __del__(self):
        try:
            ptr = self.engine.ptr
            if ptr:  # None once the engine is gone (interpreter exit)
                _lib.engine_release(ptr, self.id)
        except Exception:  # interpreter shutdown, or never offloaded
            pass


class _ViewDone:
    """Attached to the buffer a view of leased memory reads: when the last tensor on it
    is gone, the engine may free the bytes."""

    __slots__ = ("engine", "id")

    def __init__(self, engine, id_):
        self.engine, self.id = engine, id_

    def __del__(self):
        try:
            ptr = self.engine.ptr
            if ptr:
                _lib.engine_view_done(ptr, self.id)
        except Exception:
            pass


class Stash:
    """A session with actstashd: saved-tensor offload hooks and their stats.

    Thread model: pack/unpack run on the threads autograd runs them on; the native
    engine is thread-safe; copies run on its copy threads (or CUDA streams).
    """

    def __init__(self, client: Any, on_unavailable: str = "raise", prefetch: int = 2,
                 cuda: bool = True, device_pool: Optional[int] = None,
                 downcast: Optional[str] = None, copy_delay_us: int = 0, seed: int = 0,
                 cpu_views: bool = True, max_in_flight_bytes: Any = None,
                 simulate_link_gbps: Optional[float] = None) -> None:
        if prefetch < 0:
            raise ValueError("prefetch must be >= 0")
        self._client = client
        self._attached = client is not None and client.attached
        handle = ctypes.c_void_p()
        settings = {"cpu_views": bool(cpu_views), "prefetch": int(prefetch), "cuda": bool(cuda),
                    "device_pool": -1 if device_pool is None else int(device_pool),
                    "pool_importer": current_cuda_device() if device_pool is not None else -1,
                    "downcast_bf16": downcast == "bf16",
                    "on_failure": "raise" if on_unavailable == "raise" else "keep",
                    "copy_delay_us": int(copy_delay_us), "seed": int(seed)}
        if simulate_link_gbps is not None:
            if isinstance(simulate_link_gbps, bool) or \
                    not isinstance(simulate_link_gbps, (int, float)) or \
                    not 0 < simulate_link_gbps < 1e6:
                raise ValueError("simulate_link_gbps must be a positive number of GB/s, not "
                                 f"{simulate_link_gbps!r}")
            settings["simulated_link_bytes_per_second"] = max(1, round(simulate_link_gbps * 1e9))
        if max_in_flight_bytes is not None:
            settings["max_in_flight_bytes"] = _lib.parse_size(
                max_in_flight_bytes, what="max_in_flight_bytes")
        callbacks = _lib.EngineCallbacks(_lib.PY_INCREF, _lib.PY_DECREF, _lib.PY_SAVE_THREAD,
                                         _lib.PY_RESTORE_THREAD)
        code = _lib.engine_create(client.handle if client is not None else None,
                                  _lib.settings_json(settings), ctypes.byref(callbacks),
                                  ctypes.byref(handle))
        if code:
            _lib.raise_for(code)
        self._engine = _Engine(handle.value)
        # What the engine decided (defaults, and the test knob's inline rule), read back.
        settings = _lib.engine_settings(handle.value)
        self.max_in_flight_bytes = settings["max_in_flight_bytes"]
        self._downcast = settings["downcast_bf16"]
        self._inline_bytes = settings["inline_store_bytes"]
        # A simulated link: every CPU store crosses it (none is copied inline).
        self.simulated_link_bps = settings["simulated_link_bytes_per_second"]
        self._view_min_bytes = settings["view_min_bytes"]
        self._unpack_out_len = 5 + 2 * prefetch
        self.prefetch_depth = prefetch
        self.cpu_views = settings["cpu_views"]
        self._planner: Any = None  # wrap(policy="auto")'s, for plan()
        self._tls = threading.local()
        self._keep: Dict[int, Any] = {}  # storage address -> StorageWeakRef of a kept storage
        self._min_bytes = 0
        self._warned = client is None
        self._cuda_warned = False

    # -- public --------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return bool(_lib.engine_available(self._engine.ptr))

    @property
    def client(self) -> Any:
        """The native client (actstash._native.lib.Client), or None without a daemon."""
        return self._client

    def offload(self, min_bytes: Optional[int] = None) -> ContextManager[None]:
        """Context manager: saved tensors of at least min_bytes (default 64 KiB, the
        engine's default_min_bytes) are offloaded."""
        return self._hooks(_lib.DEFAULT_MIN_BYTES if min_bytes is None else min_bytes)

    def plan(self) -> Any:
        """The automatic plan (wrap(..., policy="auto")) of the latest input shape: a
        report whose str() is a table (block, bytes, choice, predicted and measured time
        and memory). Before the first step, a pending report (its `pending` says what the
        first step does; its numbers are None). None without policy="auto"."""
        return self._planner.report() if self._planner is not None else None

    def copy_share(self, probe_store_bps: float = 0.0,
                   probe_fetch_bps: float = 0.0) -> Optional[Dict[str, Any]]:
        """The node's copy bandwidth and this session's share of it while the other
        sessions on the daemon copy too: a dict of the daemon's CopyShareReply ("node":
        node_bytes_per_second, node_source, copying_sessions, window_seconds;
        "share_bytes_per_second", 0 when unknown), or None without a daemon. The probe
        rates say what this process's copies reached alone (bytes/s, shown in the daemon's
        stats). Asking counts this session as copying for the daemon's window (30 s):
        policy="auto" asks at its profile and about once a second while it trains."""
        if self._client is None or not self.available:
            return None
        try:
            return self._client.copy_share(probe_store_bps, probe_fetch_bps)
        except StashInvalidArgument:
            raise  # the caller's rates: theirs to fix
        except StashError:
            return None

    def keep(self, *tensors_or_modules: Any) -> None:
        """Never offload these tensors (nor other tensors on their storage), or the
        parameters and buffers of these modules. Held weakly: once a kept storage is
        freed, its memory is no longer special (an address the allocator reuses is
        offloaded normally)."""
        for item in tensors_or_modules:
            tensors = (list(item.parameters()) + list(item.buffers())
                       if isinstance(item, torch.nn.Module) else [item])
            for t in tensors:
                self._keep[storage_address(t)] = storage_ref(t)
        self._prune_keep()

    def _prune_keep(self):
        for address in [a for a, ref in self._keep.items() if ref.expired()]:
            del self._keep[address]

    def _kept(self, t):
        address = storage_address(t)
        ref = self._keep.get(address)
        if ref is None:
            return False
        if not ref.expired():
            return True
        del self._keep[address]  # freed: its old address means nothing now
        return False

    def synchronize(self) -> None:
        """Waits for every copy in flight (and drops the sources they held), and for the
        releases that dropping them caused."""
        for _ in range(2):  # the second round: releases queued by dropping the first
            _lib.engine_wait(self._engine.ptr)    # without the GIL: copies finish
            _lib.engine_reap(self._engine.ptr, 0)  # with it: sources (owners) dropped
        self._raise_pending()

    def stats(self) -> Dict[str, Any]:
        """Counters of the engine (offloaded/kept per reason/fetched/views/prefetch/live/peak/
        in flight/wait), what keep() holds, and the daemon's view (leases) when connected."""
        _lib.engine_reap(self._engine.ptr, 0)
        values = (ctypes.c_uint64 * len(_lib.STAT_NAMES))()
        _lib.engine_stats(self._engine.ptr, values, len(values))
        out = dict(zip(_lib.STAT_NAMES, values))
        out["wait_seconds"] = out["wait_ns"] / 1e9
        out["cuda_kept"] = out["kept_device"]
        self._prune_keep()
        out["keep_registered"] = len(self._keep)
        if self._client is not None and self.available:
            try:
                daemon = self._client.stats()
                # Which daemon serves this session (a node's, or one this process started).
                out["daemon_pid"] = daemon["daemon_pid"]
                out["daemon_version"] = daemon["daemon_version"]
                out["leased_bytes"] = daemon["self"]["leased_bytes"]
                out["leases"] = daemon["self"]["leases"]
                out["attached"] = daemon["self"]["attached"]
                # The NUMA node this process leases from (-1: none said yet) and the
                # leases the daemon could only give from another node's memory.
                out["numa_node"] = daemon["self"]["numa_node"]
                out["leases_off_node"] = daemon["self"]["leases_off_node"]
                # Spill tier (actstashd --spill-dir), cumulative, as the daemon counts.
                spill = daemon["self"]["spill"] or {}
                out["bytes_spilled"] = spill.get("spilled_bytes", 0)
                out["bytes_restored"] = spill.get("restored_bytes", 0)
                # Pool memory the daemon asked this session back for others that
                # waited, and how long since it last copied (-1: never).
                out["reclaims_asked"] = daemon["self"]["reclaims_asked"]
                out["reclaim_bytes_asked"] = daemon["self"]["reclaim_bytes_asked"]
                out["idle_ms"] = daemon["self"]["idle_ms"]
            except StashError:
                pass
            info = self._client.info()
            usage = info["zero_copy"]
            # Calls that waited while the daemon was replaced (actstashd --take-over)
            # or restarted; attach connections made again after a restart.
            out["daemon_pauses"] = info["daemon_pauses"]
            out["daemon_reattaches"] = info["daemon_reattaches"]
            # Optimizer state this session keeps in the pool (actstash.optim:
            # reserve()d buffers, which the client counts and reports).
            out["optimizer_state_bytes"] = usage["state_bytes"]
            out["spilled_now_bytes"] = usage["spilled_bytes"]  # on the daemon's disk now
            out["spills"] = usage["spills"]
            out["restores"] = usage["restores"]
            out["restores_ahead"] = usage["restores_ahead"]  # read back before needed
            # What this session gave back when asked (retained leases, spilled blocks).
            out["reclaims_answered"] = usage["reclaims_answered"]
            out["reclaim_bytes_given"] = usage["reclaim_bytes_given"]
            out["spill_wait_seconds"] = usage["spill_wait_ns"] / 1e9
            out["restore_wait_seconds"] = usage["restore_wait_ns"] / 1e9
            out["pinned_bytes"] = usage["pinned_bytes"]
            out["unpinned_leases"] = usage["unpinned_leases"]
            out["pin_error"] = self._client.pin_error
        return out

    def close(self) -> None:
        """Waits for the copies in flight and ends the session: what it stored is
        given back to the daemon."""
        self.synchronize()
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> Stash:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- hooks ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _hooks(self, min_bytes):
        previous = self._min_bytes
        self._min_bytes = min_bytes
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._min_bytes = previous
        # Raised here, not in the pack hook: store failures are deferred (copies run
        # asynchronously), and torch 1.13 turns exceptions raised in hooks into plain
        # RuntimeErrors (2.x lets them through with their own type).
        self._raise_pending()

    def _raise_pending(self):
        code = _lib.engine_take_error(self._engine.ptr)
        if code:
            _lib.raise_for(code)
        if _lib.engine_take_notice(self._engine.ptr):
            warnings.warn("actstash: " + _lib.last_error_text(), RuntimeWarning, stacklevel=3)
        if not self._warned and not self.available:
            self._warned = True
            warnings.warn("actstash: offload disabled after a failure; keeping tensors "
                          "in-process", RuntimeWarning, stacklevel=3)

    def _keep_flag(self, t):
        """Why t must stay where it is, as engine flags (0: the engine decides)."""
        if kept_layout(t):
            return _KEEP_LAYOUT
        if t.device.type not in ("cpu", "cuda"):
            return _KEEP_DEVICE  # meta, xpu, mps, ...: no engine copies those
        if aliases_parameter(t):
            return _KEEP_PARAMETER
        if self._keep and self._kept(t):
            return _KEEP_LISTED
        return 0

    def _copied_inline(self, nbytes, cuda, boundary):
        """The engine's inline rule, with its settings read back: a CPU tensor stored in
        leased memory is done when pack returns (its source never held, its copy
        compute-thread time) when it is a checkpoint boundary's input (copied on the
        packing thread, or with a simulated link through the copy engine and waited
        for) or, without a simulated link, at most inline_store_bytes large. The owner
        passed to pack and the planner's model of what is in flight follow it."""
        return not cuda and self._attached and (
            boundary or (not self.simulated_link_bps and nbytes <= self._inline_bytes))

    def _pack(self, t, min_bytes=None, boundary=False):
        """The pack hook (and actstash.checkpoint's boundary, which stores a detached
        alias of `t`): returns `t` when kept, else the _Saved autograd holds."""
        if min_bytes is None:
            min_bytes = self._min_bytes
        engine = self._engine
        nbytes = t.numel() * t.element_size()
        if nbytes < min_bytes or nbytes == 0:
            _lib.engine_pack(engine.ptr, 0, nbytes, _KEEP_SMALL, None, None, 0, 0, None, None,
                             min_bytes)
            return t
        flags = self._keep_flag(t)
        device = t.device
        cuda = device.type == "cuda"
        if not flags and cuda and torch.cuda.is_current_stream_capturing():
            flags = _KEEP_DEVICE  # inside CUDA graph capture: copies cannot be recorded
        if flags:
            _lib.engine_pack(engine.ptr, 0, nbytes, flags, None, None, 0, 0, None, None,
                             min_bytes)
            return t
        dense = t.is_contiguous() or _is_dense(t)
        flags = t.element_size() | (_FP32 if t.dtype == torch.float32 else 0)
        if boundary:
            flags |= _SYNC  # the function may change its input in place right after
        sizes = strides = None
        if dense:
            flags |= _DENSE
        else:
            ndim = t.dim()
            sizes = (ctypes.c_int64 * ndim)(*t.shape)
            strides = (ctypes.c_int64 * ndim)(*t.stride())
            flags |= ndim << _NDIM_SHIFT
        stream = 0
        if cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            flags |= (index + 1) << _DEVICE_SHIFT
            stream = _stream_of(device)
        # The engine holds the source only while it copies asynchronously; detached so
        # that holding it does not hold its graph (which holds the _Saved).
        owner = t if not boundary and self._copied_inline(nbytes, cuda, False) else t.detach()
        saved = _Saved()
        if dense and not cuda:
            id_ = _lib.engine_pack_dense_cpu(engine.ptr, t.data_ptr(), nbytes, flags, t._version,
                                             owner, saved)
        else:
            id_ = _lib.engine_pack(engine.ptr, t.data_ptr(), nbytes, flags, sizes, strides,
                                   stream, t._version, owner, saved, min_bytes)
        if not id_:
            if cuda:
                self._warn_cuda()
            return t
        saved.id = id_
        saved.engine = engine
        saved.dtype, saved.shape, saved.stride = t.dtype, t.shape, t.stride()
        saved.device, saved.dense, saved.nbytes = device, dense, nbytes
        # torch checks saved versions only for tensors saved without hooks: the engine
        # compares the version at unpack, read through the saved tensor while it lives.
        saved.ref = weakref.ref(t)
        base = t._base
        saved.base = weakref.ref(base) if base is not None else None
        return saved

    def _warn_cuda(self):
        if not self._cuda_warned and self._client is not None:
            pin_error = self._client.pin_error
            if pin_error:
                self._cuda_warned = True
                warnings.warn(f"actstash: {pin_error}", RuntimeWarning, stacklevel=4)

    def _unpack(self, saved, check_version=True):
        """The unpack hook (and actstash.checkpoint's boundary, without the version
        check: the function may change its input in place after it was stored)."""
        if isinstance(saved, torch.Tensor):
            return saved
        version = _UNKNOWN_VERSION
        if check_version:
            # Through the saved tensor, else its base (views share its counter).
            t = saved.ref()
            if t is None and saved.base is not None:
                t = saved.base()
            if t is not None:
                version = t._version
        engine = self._engine
        try:
            out = self._tls.out  # one per thread: unpacks may run on several
        except AttributeError:
            out = self._tls.out = (ctypes.c_uint64 * self._unpack_out_len)()
        device = saved.device
        if device.type == "cpu" and saved.nbytes < self._view_min_bytes and not self._downcast:
            # Copied back (not a view): allocate first, and one native call unpacks and
            # copies (unless the source is still held: then dst goes unused).
            dst = _materialize(saved)
            code = _lib.engine_unpack_into(engine.ptr, saved.id, version, dst.data_ptr(),
                                           saved.nbytes, out, self._unpack_out_len)
            if code:
                error = _lib.error_for(code)
                _take_offers(out)  # handed over before the copy failed: dropped
                raise error
            if out[0] == _COPIED:
                if out[4]:  # the hot path makes no call when nothing is offered
                    self._prefetch(_take_offers(out))
                return self._restride(saved, dst)
        else:
            code = _lib.engine_unpack(engine.ptr, saved.id, version, out, self._unpack_out_len)
            if code:
                _lib.raise_for(code)
        kind, address, nbytes = out[0], out[1], out[2]
        handed = _lib.take_object(address) if kind in (_SOURCE, _PREFETCHED) else None
        offers = _take_offers(out) if out[4] else None
        if kind == _VIEW:
            buf = (ctypes.c_char * nbytes).from_address(address)
            buf._actstash = _ViewDone(engine, saved.id)
            flat = torch.frombuffer(buf, dtype=saved.dtype)
            if offers:
                self._prefetch(offers)
            if saved.dense:
                return flat.as_strided(saved.shape, saved.stride)
            return self._restride(saved, flat.view(saved.shape))
        if kind == _SOURCE:
            if offers:
                self._prefetch(offers)
            return self._restride(saved, handed)
        stream = _stream_of(saved.device)
        if kind == _PREFETCHED:
            dst = handed
            code = _lib.engine_finish(engine.ptr, saved.id, stream)
            if saved.device.type == "cuda":
                # Allocated on the stream current when the prefetch was issued: tell the
                # caching allocator who uses it now.
                dst.record_stream(torch.cuda.current_stream(saved.device))
        else:
            dst = _materialize(saved)
            code = _lib.engine_fetch_into(engine.ptr, saved.id, dst.data_ptr(), saved.nbytes,
                                          stream)
        # Prefetches only now: the fetch stream is first in, first out, and the copy
        # backward needs now must not queue behind copies it needs later.
        if offers:
            self._prefetch(offers)
        if code:
            _lib.raise_for(code, "actstash: fetching a saved tensor failed")
        return self._restride(saved, dst)

    def _prefetch(self, offers):
        """Starts the fetches the engine offered (the next saved tensors backward reads):
        (id, _Saved) pairs from _take_offers."""
        engine = self._engine
        for id_, saved in offers:
            try:
                dst = _materialize(saved)
            except Exception:  # speculative: out of memory now must not fail this unpack
                continue
            _lib.engine_prefetch(engine.ptr, id_, dst.data_ptr(), saved.nbytes, dst,
                                 _stream_of(saved.device))

    @staticmethod
    def _restride(p, t):
        """Gives a tensor fetched contiguous the strides the saved one had, so that the
        kernels of backward see the same layout (and produce the same bits)."""
        if p.dense or t.stride() == p.stride:
            return t
        broadcast = [st == 0 and sz > 1 for st, sz in zip(p.stride, p.shape)]
        try:
            if not any(broadcast):  # a view with gaps: same strides, unused gaps
                out = torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=p.device)
                out.copy_(t)
                return out
            # A broadcast (expand): keep one copy along the stride-0 dims, then view it
            # with the original strides.
            compact = t.reshape(p.shape)
            for dim, b in enumerate(broadcast):
                if b:
                    compact = compact.narrow(dim, 0, 1)
            base = torch.empty_strided(compact.shape, [st if st else 1 for st in p.stride],
                                       dtype=p.dtype, device=p.device)
            base.copy_(compact)
            return base.as_strided(p.shape, p.stride)
        except RuntimeError:
            return t.reshape(p.shape)  # not expected: overlaps other than broadcasts are kept


def _take_offers(out):
    """The saved tensors an unpack's answer `out` offers for prefetch, as (id, _Saved)
    pairs: every cookie is a reference handed over, taken here even when unused."""
    return [(out[5 + 2 * i], _lib.take_object(out[6 + 2 * i])) for i in range(out[4])]


def _stream_of(device):
    """The current stream of a CUDA device as an integer handle; 0 for the CPU (ignored)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream


def _materialize(p):
    """A tensor with p's dtype, shape and strides, to fetch p into (contiguous when p is
    not dense: restrided after the fetch)."""
    if p.dense:
        return torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=p.device)
    return torch.empty(p.shape, dtype=p.dtype, device=p.device)
