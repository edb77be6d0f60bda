"""Stash: a session with actstashd plus the saved-tensor hooks that use it."""
import contextlib
import os
import threading
import time
import warnings
import weakref

import torch

from actstash import _native

_DEFAULT_SOCKET_HINT = (
    "start it with `actstashd` (or `actstashd --socket PATH` and set ACTSTASH_ADDRESS=PATH)")


def connect(address=None, quota=None, on_unavailable="raise", *, name=None, attach="auto",
            timeout=30.0, connect_timeout=5.0, prefetch=2, copy_delay_us=0, seed=0):
    """Opens a session with actstashd and returns a Stash.

    address: socket path, unix:///path or host:port; default ACTSTASH_ADDRESS, else the
      daemon's default socket. quota: bytes this trainer may hold (default: the daemon's).
    on_unavailable: "raise" (StashUnavailable, within connect_timeout) or "keep" (warn,
      and keep tensors in-process: training goes on without offload).
    copy_delay_us: test knob; each asynchronous copy first sleeps up to this long.
    """
    if on_unavailable not in ("raise", "keep"):
        raise ValueError("on_unavailable must be 'raise' or 'keep'")
    address = address or os.environ.get("ACTSTASH_ADDRESS", "")
    try:
        client = _native.Client(address=address, quota=int(quota or 0),
                                name=name or f"torch-{os.getpid()}", attach=attach,
                                rpc_timeout_ms=int(timeout * 1000),
                                connect_timeout_ms=int(connect_timeout * 1000))
    except _native.StashUnavailable as error:
        if on_unavailable == "raise":
            raise _native.StashUnavailable(f"{error}; {_DEFAULT_SOCKET_HINT}") from None
        warnings.warn(f"actstash: daemon unavailable ({error}); keeping tensors in-process",
                      RuntimeWarning, stacklevel=2)
        client = None
    engine = _native.CopyEngine(max_delay_us=copy_delay_us, seed=seed)
    return Stash(client, engine, on_unavailable=on_unavailable, prefetch=prefetch)


class _Packed:
    """One offloaded saved tensor. Lives exactly as long as autograd keeps the
    saved variable: dropping it (graph freed) releases the daemon's copy."""

    __slots__ = ("stash", "pending", "src", "dtype", "shape", "stride", "dense", "nbytes",
                 "fetched", "fetch_event", "index", "__weakref__")

    def __del__(self):
        stash = self.stash
        if stash is not None and self.pending is not None:
            stash._release(self)


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


class Stash:
    """A session with actstashd: saved-tensor offload hooks, copy engine, stats.

    Thread model: pack/unpack run on the threads autograd runs them on; the
    bookkeeping is under a lock; copies run on the copy engine's threads.
    """

    def __init__(self, client, engine, on_unavailable="raise", prefetch=2):
        self._client = client
        self._engine = engine
        self._on_unavailable = on_unavailable
        self._prefetch = prefetch
        self._lock = threading.RLock()
        self._order = []          # weakrefs of _Packed, in store order (for prefetch)
        self._live = 0            # _Packed alive; _order restarts when it drops to 0
        # (weakref of _Packed, pending store, source tensor): the source stays alive until
        # its store finished, even if the _Packed (its graph) is gone first.
        self._in_flight = []
        # (fetch event, destination tensor) of fetches whose _Packed died first: the
        # destination must outlive the copy into it.
        self._orphan_fetches = []
        self._keep = set()        # storage data_ptrs never to offload (params, buffers)
        self._min_bytes = 0
        self._unavailable = client is None
        self._pending_error = None  # a store failure, raised when the offload scope ends
        self._stats = dict(bytes_offloaded=0, bytes_fetched=0, bytes_kept=0, tensors_offloaded=0,
                           tensors_kept=0, live_bytes=0, peak_live_bytes=0, wait_seconds=0.0,
                           prefetch_hits=0)

    # -- public --------------------------------------------------------------------------
    @property
    def available(self):
        return not self._unavailable

    @property
    def client(self):
        return self._client

    def offload(self, min_bytes=64 << 10):
        """Context manager: saved tensors of at least min_bytes are offloaded."""
        return self._hooks(min_bytes)

    def keep(self, *tensors_or_modules):
        """Never offload these tensors, or the parameters and buffers of these modules."""
        for item in tensors_or_modules:
            if isinstance(item, torch.nn.Module):
                for t in list(item.parameters()) + list(item.buffers()):
                    self._keep.add(t.storage().data_ptr())
            else:
                self._keep.add(item.storage().data_ptr())

    def synchronize(self):
        """Waits for every copy in flight (and drops the sources they held), and for the
        releases that dropping them caused."""
        self._engine.synchronize()
        self._reap(wait=True)
        self._engine.synchronize()

    def stats(self):
        """Bytes offloaded/fetched/kept, live and peak offloaded bytes, copies in flight,
        seconds spent waiting on copies, and the daemon's view (leases) when connected."""
        self._reap(wait=False)
        with self._lock:
            out = dict(self._stats)
            out["in_flight"] = len(self._in_flight)
        if self._client is not None and not self._unavailable:
            try:
                daemon = self._client.stats()
                out["leased_bytes"] = daemon["self"]["leased_bytes"]
                out["leases"] = daemon["self"]["leases"]
                out["attached"] = daemon["self"]["attached"]
            except _native.StashError:
                pass
        return out

    def close(self):
        self.synchronize()
        if self._client is not None:
            self._client.close()

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
        # Raised here, not in the pack hook: torch turns exceptions raised in
        # hooks into plain RuntimeErrors.
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    def _should_offload(self, t):
        if self._unavailable or t.layout != torch.strided or t.device.type != "cpu":
            return False
        if t.numel() * t.element_size() < max(self._min_bytes, 1):
            return False
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return False  # parameters are saved by reference anyway
        base = t._base
        if base is not None and (isinstance(base, torch.nn.Parameter) or
                                 (base.is_leaf and base.requires_grad)):
            return False  # a view of a parameter (e.g. weight.t()): aliases what is kept
        return t.storage().data_ptr() not in self._keep

    def _pack(self, t):
        try:
            self._reap(wait=False)
        except _native.StashError as error:
            self._pending_error = self._pending_error or error
        if self._pending_error is not None or not self._should_offload(t):
            with self._lock:
                self._stats["tensors_kept"] += 1
                self._stats["bytes_kept"] += t.numel() * t.element_size()
            return t
        return self._store(t)

    def _store(self, t):
        """Starts an asynchronous copy of t to the daemon; returns its _Packed."""
        p = _Packed()
        p.stash = None
        p.pending = None
        p.dtype, p.shape, p.stride = t.dtype, t.shape, t.stride()
        p.dense = _is_dense(t)
        # Detached: holding the source must not hold its autograd graph (that graph holds
        # this _Packed). Non-dense views are gathered (views with gaps, broadcasts).
        src = t.detach() if p.dense else t.detach().contiguous()
        p.nbytes = src.numel() * src.element_size()
        p.src = src
        p.fetched = None
        p.fetch_event = None
        p.pending = self._engine.store_async(self._client, src.data_ptr(), p.nbytes)
        p.stash = self
        with self._lock:
            p.index = len(self._order)
            self._order.append(weakref.ref(p))
            self._live += 1
            self._in_flight.append((weakref.ref(p), p.pending, src))
            self._stats["tensors_offloaded"] += 1
            self._stats["bytes_offloaded"] += p.nbytes
            self._stats["live_bytes"] += p.nbytes
            self._stats["peak_live_bytes"] = max(self._stats["peak_live_bytes"],
                                                 self._stats["live_bytes"])
        return p

    def _reap(self, wait):
        """Drops the sources of finished stores; surfaces store failures."""
        with self._lock:
            in_flight, self._in_flight = self._in_flight, []
        failed = None
        still = []
        for entry in in_flight:
            ref, pending, _src = entry
            if not wait and not pending.done():
                still.append(entry)
                continue
            p = ref()
            try:
                pending.wait()
                if p is not None:
                    p.src = None  # the daemon has the bytes: the trainer's copy may go
            except _native.StashError as error:
                if p is None:
                    continue  # nobody needs that tensor any more
                if self._on_unavailable == "raise":
                    failed = failed or error
                else:
                    self._degrade(error)  # p.src stays: the tensor is kept in-process
        with self._lock:
            self._in_flight.extend(still)
            self._orphan_fetches = [(event, dst) for event, dst in self._orphan_fetches
                                    if not (wait or event.done())]
        if failed is not None:
            raise failed

    def _degrade(self, error):
        if not self._unavailable:
            self._unavailable = True
            warnings.warn(f"actstash: offload disabled ({error}); keeping tensors in-process",
                          RuntimeWarning)

    def _materialize(self, p):
        """A tensor with p's dtype, shape and strides, to fetch p into."""
        if p.dense:
            return torch.empty_strided(p.shape, p.stride, dtype=p.dtype)
        return torch.empty(p.shape, dtype=p.dtype)  # contiguous; restrided after the fetch

    def _fetch_async(self, p):
        out = self._materialize(p)
        p.fetched = out
        p.fetch_event = self._engine.fetch_async(p.pending, out.data_ptr(), p.nbytes)

    def _unpack(self, p):
        if isinstance(p, torch.Tensor):
            return p
        if p.src is not None:  # still in flight, or kept after a failed store
            if not p.pending.done() or self._unavailable:
                return self._restride(p, p.src)
        start = time.perf_counter()
        with self._lock:
            hit = p.fetch_event is not None
            if not hit:
                self._fetch_async(p)
            self._prefetch_before(p.index)
        try:
            p.fetch_event.wait()
        except _native.StashError as error:
            if self._on_unavailable == "keep" and p.src is not None:
                return self._restride(p, p.src)
            raise
        out = p.fetched
        p.fetched, p.fetch_event = None, None  # a second backward fetches again
        with self._lock:
            self._stats["wait_seconds"] += time.perf_counter() - start
            self._stats["bytes_fetched"] += p.nbytes
            self._stats["prefetch_hits"] += int(hit)
        return self._restride(p, out)

    def _restride(self, p, t):
        """Gives a tensor fetched contiguous the strides the saved one had, so that the
        kernels of backward see the same layout (and produce the same bits)."""
        if p.dense or t.stride() == p.stride:
            return t
        broadcast = [st == 0 and sz > 1 for st, sz in zip(p.stride, p.shape)]
        try:
            if not any(broadcast):  # a view with gaps: same strides, unused gaps
                out = torch.empty_strided(p.shape, p.stride, dtype=p.dtype)
                out.copy_(t)
                return out
            # A broadcast (expand): keep one copy along the stride-0 dims, then view it
            # with the original strides.
            compact = t.view(p.shape)
            for dim, b in enumerate(broadcast):
                if b:
                    compact = compact.narrow(dim, 0, 1)
            base = torch.empty_strided(compact.shape, [st if st else 1 for st in p.stride],
                                       dtype=p.dtype)
            base.copy_(compact)
            return base.as_strided(p.shape, p.stride)
        except RuntimeError:
            return t.view(p.shape)  # an unusual overlap: same values, contiguous

    def _prefetch_before(self, index):
        """Backward reads saved tensors in reverse order of storage: start fetching the
        next ones (those stored just before `index`)."""
        issued = 0
        i = index - 1
        lowest = max(0, index - 8 * max(self._prefetch, 1))  # bounded scan past dead entries
        while i >= lowest and issued < self._prefetch:
            q = self._order[i]()
            if q is not None and q.fetch_event is None and q.pending is not None:
                self._fetch_async(q)
                issued += 1
            i -= 1

    def _release(self, p):
        # Called from _Packed.__del__: may run on any thread, during gc.
        try:
            self._engine.release_async(p.pending)
        except Exception:  # interpreter shutdown: the session close frees it anyway
            return
        with self._lock:
            if p.fetch_event is not None and not p.fetch_event.done():
                self._orphan_fetches.append((p.fetch_event, p.fetched))
            self._stats["live_bytes"] -= p.nbytes
            self._live -= 1
            if self._live == 0:
                self._order.clear()  # every graph that used it is gone
