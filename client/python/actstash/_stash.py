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
            timeout=30.0, connect_timeout=5.0, prefetch=2, copy_delay_us=0, seed=0, pin="auto",
            cuda=True, device_pool=None, downcast=None):
    """Opens a session with actstashd and returns a Stash.

    address: socket path, unix:///path or host:port; default ACTSTASH_ADDRESS, else the
      daemon's default socket. quota: bytes this trainer may hold (default: the daemon's).
    on_unavailable: "raise" (StashUnavailable, within connect_timeout) or "keep" (warn,
      and keep tensors in-process: training goes on without offload).
    copy_delay_us: test knob; each asynchronous copy of CPU tensors first sleeps up to this long.
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
    """
    if downcast not in (None, "bf16"):
        raise ValueError("downcast must be None or 'bf16'")
    if on_unavailable not in ("raise", "keep"):
        raise ValueError("on_unavailable must be 'raise' or 'keep'")
    address = address or os.environ.get("ACTSTASH_ADDRESS", "")
    try:
        client = _native.Client(address=address, quota=int(quota or 0),
                                name=name or f"torch-{os.getpid()}", attach=attach,
                                rpc_timeout_ms=int(timeout * 1000),
                                connect_timeout_ms=int(connect_timeout * 1000), pin=pin,
                                cuda_device=_current_cuda_device() if device_pool is not None
                                else 0)
    except _native.StashUnavailable as error:
        if on_unavailable == "raise":
            raise _native.StashUnavailable(f"{error}; {_DEFAULT_SOCKET_HINT}") from None
        warnings.warn(f"actstash: daemon unavailable ({error}); keeping tensors in-process",
                      RuntimeWarning, stacklevel=2)
        client = None
    engine = _native.CopyEngine(max_delay_us=copy_delay_us, seed=seed)
    if client is not None and device_pool is not None:
        pools = [p["device"] for p in client.device_pools()]
        if device_pool not in pools:
            client.close()
            raise ValueError(f"the daemon has no device pool on GPU {device_pool} (pools: "
                             f"{pools or 'none; start actstashd with --device-pool GPU:SIZE '}"
                             f"{'' if pools else '--allow-uid UID'})")
    return Stash(client, engine, on_unavailable=on_unavailable, prefetch=prefetch, cuda=cuda,
                 device_pool=device_pool, downcast=downcast)


def _current_cuda_device():
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


class _Packed:
    """One offloaded saved tensor. Lives exactly as long as autograd keeps the
    saved variable: dropping it (graph freed) releases the daemon's copy."""

    __slots__ = ("stash", "engine", "device", "pending", "src", "dtype", "shape", "stride",
                 "dense", "nbytes", "fetched", "fetch_event", "index", "version", "saved",
                 "src_version", "modified", "downcast", "__weakref__")

    def __del__(self):
        stash = self.stash
        if stash is not None and self.pending is not None:
            stash._release(self)


def _stream_of(device):
    """The current stream of a CUDA device as an integer handle; 0 for the CPU (ignored)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream


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

    def __init__(self, client, engine, on_unavailable="raise", prefetch=2, cuda=True,
                 device_pool=None, downcast=None):
        self._client = client
        self._engine = engine     # host engine: CPU tensors
        self._cuda = cuda
        self._downcast = downcast
        self._device_pool = -1 if device_pool is None else int(device_pool)
        # The device whose context imported the pool: only its tensors go there.
        self._pool_importer = _current_cuda_device() if device_pool is not None else -1
        self._cuda_engines = {}   # device index -> CUDA engine, or None when unusable
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
                           prefetch_hits=0, cuda_kept=0)

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
        engines = self._engines()
        for engine in engines:
            engine.synchronize()
        self._reap(wait=True)
        for engine in engines:
            engine.synchronize()

    def _engines(self):
        return [self._engine] + [e for e in self._cuda_engines.values() if e is not None]

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
            usage = self._client.zero_copy_usage()
            out["pinned_bytes"] = usage["pinned_bytes"]
            out["unpinned_leases"] = usage["unpinned_leases"]
            out["pin_error"] = self._client.pin_error
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

    def _engine_for(self, t):
        """The copy engine for t's device, or None when t stays where it is."""
        if t.device.type == "cpu":
            return self._engine
        if t.device.type != "cuda" or not self._cuda or not self._client.attached:
            return None  # a CUDA tensor goes straight into leased (pinned) memory only
        if torch.cuda.is_current_stream_capturing():
            return None  # inside CUDA graph capture: copies and events cannot be recorded
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if index not in self._cuda_engines:
            try:
                self._cuda_engines[index] = _native.cuda_copy_engine(device=index)
            except _native.StashError as error:
                warnings.warn(f"actstash: CUDA tensors stay on the GPU ({error})",
                              RuntimeWarning, stacklevel=4)
                self._cuda_engines[index] = None
            else:
                pin_error = self._client.pin_error
                if pin_error:
                    warnings.warn(f"actstash: {pin_error}", RuntimeWarning, stacklevel=4)
        return self._cuda_engines[index]

    def _should_offload(self, t):
        if self._unavailable or t.layout != torch.strided:
            return False
        if t.numel() * t.element_size() < max(self._min_bytes, 1):
            return False
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return False  # parameters are saved by reference anyway
        base = t._base
        if base is not None and (isinstance(base, torch.nn.Parameter) or
                                 (base.is_leaf and base.requires_grad)):
            return False  # a view of a parameter (e.g. weight.t()): aliases what is kept
        if t.storage().data_ptr() in self._keep:
            return False
        if t.device.type != "cpu" and self._engine_for(t) is None:
            with self._lock:
                self._stats["cuda_kept"] += 1
            return False
        return True

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
        try:
            return self._store(t)
        except _native.StashError as error:
            # A reservation failed here, not on the copy stream: same outcome as a failed
            # asynchronous store (raised when the offload scope ends, or degrade).
            if self._on_unavailable == "raise":
                self._pending_error = self._pending_error or error
            else:
                self._degrade(error)
            with self._lock:
                self._stats["tensors_kept"] += 1
                self._stats["bytes_kept"] += t.numel() * t.element_size()
            return t

    def _store(self, t):
        """Starts an asynchronous copy of t to the daemon; returns its _Packed."""
        p = _Packed()
        p.stash = None
        p.pending = None
        p.engine = self._engine_for(t)
        p.device = t.device
        p.dtype, p.shape, p.stride = t.dtype, t.shape, t.stride()
        p.dense = _is_dense(t)
        # Lossy bf16 storage (opt-in) for dense fp32 tensors on the zero-copy path.
        downcast = (self._downcast == "bf16" and t.dtype == torch.float32 and p.dense and
                    self._client.attached)
        p.nbytes = t.numel() * (2 if downcast else t.element_size())  # bytes stored
        p.downcast = downcast
        p.fetched = None
        p.fetch_event = None
        # torch checks saved versions only for tensors saved without hooks: an in-place
        # change after saving must still fail backward (not race with the copy). Checked
        # while the saved tensor object lives (a weak reference: it must not stay alive).
        p.version = t._version
        p.saved = weakref.ref(t)
        p.modified = False
        # Detached: holding the source must not hold its autograd graph (that graph holds
        # this _Packed). It stays alive until its copy is done (_reap).
        src = t.detach()
        if self._client.attached:
            # Straight into leased memory, on the engine's store stream after the
            # producer's stream; non-dense views (gaps, broadcasts) are gathered there.
            layout = {} if p.dense else dict(sizes=list(t.shape), strides=list(t.stride()),
                                             element_size=t.element_size())
            stream = _stream_of(t.device)
            p.pending = p.engine.store_tensor_async(self._client, src.data_ptr(), p.nbytes,
                                                    stream=stream, gather_needs_pinned=t.is_cuda,
                                                    device_pool=self._device_pool
                                                    if t.device.index == self._pool_importer
                                                    else -1, downcast="bf16" if downcast else "",
                                                    **layout)
            if p.pending is None:  # unpinned memory: a GPU kernel cannot gather into it
                src = src.contiguous()
                p.pending = p.engine.store_tensor_async(self._client, src.data_ptr(), p.nbytes,
                                                        stream=stream)
        else:  # the inline path (CPU tensors only): Client::Store on the store stream
            if not p.dense:
                src = src.contiguous()
            p.pending = p.engine.store_async(self._client, src.data_ptr(), p.nbytes)
        p.src = src
        # src shares t's version counter (unless it is a packed copy): watched until dropped.
        p.src_version = src._version
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
                    src = p.src
                    if src is not None and src._version != p.src_version:
                        p.modified = True  # changed in place after saving: unpack raises
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
            return torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=p.device)
        # contiguous; restrided after the fetch
        return torch.empty(p.shape, dtype=p.dtype, device=p.device)

    def _fetch_async(self, p):
        out = self._materialize(p)
        p.fetched = out
        # After the work on the current stream (which may still use out's memory).
        p.fetch_event = p.engine.fetch_async(p.pending, out.data_ptr(),
                                             out.numel() * out.element_size(),
                                             stream=_stream_of(p.device))

    def _unpack(self, p):
        if isinstance(p, torch.Tensor):
            return p
        saved, src = p.saved(), p.src
        if (p.modified or (saved is not None and saved._version != p.version) or
                (src is not None and src._version != p.src_version)):
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: saved at version {p.version} "
                "(tensor saved with actstash hooks)")
        try:
            self._reap(wait=False)  # drops the sources of stores done since forward
        except _native.StashError as error:
            # A failed store keeps its source (used below); raised when a scope ends.
            self._pending_error = self._pending_error or error
        if src is not None:
            # Still in flight, kept after a failed store, or done but not yet dropped:
            # the source has the bytes, and is already where it belongs. A downcast
            # tensor must come back rounded, whatever the timing: wait for its store.
            if not p.downcast:
                return self._restride(p, src)
            try:
                p.pending.wait()
            except _native.StashError:
                return self._restride(p, src)  # not stored: the exact tensor stays
        start = time.perf_counter()
        with self._lock:
            hit = p.fetch_event is not None
            if not hit:
                self._fetch_async(p)
            self._prefetch_before(p.index)
        try:
            # CPU: waits for the copy. CUDA: the current stream waits for it, not us.
            p.engine.order_after(p.fetch_event, stream=_stream_of(p.device))
        except _native.StashError as error:
            if self._on_unavailable == "keep" and p.src is not None:
                return self._restride(p, p.src)
            raise
        out = p.fetched
        if p.device.type == "cuda":
            # Allocated on the stream current when the fetch was issued (a prefetch may
            # have run elsewhere): tell the caching allocator who uses it now.
            out.record_stream(torch.cuda.current_stream(p.device))
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
                out = torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=p.device)
                out.copy_(t)
                return out
            # A broadcast (expand): keep one copy along the stride-0 dims, then view it
            # with the original strides.
            compact = t.view(p.shape)
            for dim, b in enumerate(broadcast):
                if b:
                    compact = compact.narrow(dim, 0, 1)
            base = torch.empty_strided(compact.shape, [st if st else 1 for st in p.stride],
                                       dtype=p.dtype, device=p.device)
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
            if (q is not None and q.fetch_event is None and q.pending is not None and
                    q.src is None):
                try:
                    self._fetch_async(q)
                except (RuntimeError, _native.StashError):
                    # Speculative: out of memory or a stash error now must not fail the
                    # unpack that asked for it; q's own unpack fetches (and reports) again.
                    q.fetched, q.fetch_event = None, None
                    break
                issued += 1
            i -= 1

    def _release(self, p):
        # Called from _Packed.__del__: may run on any thread, during gc.
        try:
            p.engine.release_async(p.pending)
        except Exception:  # interpreter shutdown: the session close frees it anyway
            return
        with self._lock:
            if p.fetch_event is not None and not p.fetch_event.done():
                self._orphan_fetches.append((p.fetch_event, p.fetched))
            self._stats["live_bytes"] -= p.nbytes
            self._live -= 1
            if self._live == 0:
                self._order.clear()  # every graph that used it is gone
