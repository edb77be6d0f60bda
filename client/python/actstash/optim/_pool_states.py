"""Where OffloadAdamW's pooled states live: reserve()d buffers of the session's pool
(_PoolBuffer), views of them in the state dicts, and, when parking, their being
given to the spill tier between steps and located again a piece at a time.

_PooledStates owns, on the optimizer: _buffers (pooled parameter -> {state key:
its _PoolBuffer}), _views ((parameter, key) -> its view), _pooled (the pooled
parameters, in reservation order), _parking and _chunk_bytes.
"""
import contextlib
import ctypes

import torch

from actstash.optim._masters import _MASTER


class _PoolBuffer:
    """A reserve()d buffer of the session's pool, given back once nothing views it:
    the ctypes array a tensor is made from holds this object."""

    def __init__(self, client, nbytes):
        self.client = None  # set once reserved: __del__ gives back only what was taken
        self.nbytes = nbytes
        self.ticket, self.address = client.reserve(nbytes)
        self.client = client

    def __del__(self):
        client, self.client = getattr(self, "client", None), None
        if client is None:
            return
        try:
            client.release(self.ticket, self.nbytes)
        except Exception:  # the session is gone: so is the buffer
            pass

    def tensor(self, like):
        array = (ctypes.c_byte * self.nbytes).from_address(self.address)
        array._owner = self  # keeps the buffer while any view of it lives
        return torch.frombuffer(array, dtype=like.dtype, count=like.numel()).view(like.shape)

    def park(self):
        """No view of it is used until locate(): the spill tier may take it."""
        self.client.park(self.ticket)
        self.address = None

    def locate(self):
        """Its address now (read back first when spilled); views made before park() that
        point elsewhere are stale."""
        self.address = self.client.locate(self.ticket)
        return self.address


class _PooledStates:
    """A mixin of OffloadAdamW: its pooled states' placement and parking."""

    @property
    def offloaded_bytes(self):
        """Bytes of this optimizer's state in the pool (on the device path, with the host
        copies of the parameters and their gradients)."""
        copies = [t for p in self._pooled for t in (self._host.get(p), self._host_grads.get(p))
                  if t is not None]
        return sum(t.numel() * t.element_size() for t in copies) + sum(
            t.numel() * t.element_size() for p in self._pooled
            for key, t in self.state[p].items() if key != "step")

    def _park_states(self, params):
        """Parks the pooled states of `params`: until located again the spill tier may
        take them, and the state dicts hold meta tensors of their shapes (a read of one
        fails rather than reading memory that holds something else by then)."""
        for p in params:
            for key, buffer in self._buffers.get(p, {}).items():
                buffer.park()
                placeholder = torch.empty(p.shape, dtype=torch.float32, device="meta")
                self.state[p][key] = placeholder
                if key == _MASTER:
                    self._masters[p] = placeholder

    def _locate_states(self, params):
        """The pooled states of `params` back in memory (read back first where spilled)
        and in the state dicts, until _park_states."""
        for p in params:
            for key, buffer in self._buffers.get(p, {}).items():
                view = self._view(p, key, buffer.locate())
                self.state[p][key] = view
                if key == _MASTER:
                    self._masters[p] = view

    def _view(self, p, key, address=None):
        """The fp32 view of p's pooled state `key` at `address` (its buffer's last one:
        the view it has had since construction when nothing parks)."""
        view = self._views.get((p, key))
        if view is None or (address is not None and view.data_ptr() != address):
            like = torch.empty(p.shape, dtype=torch.float32, device="meta")
            view = self._views[(p, key)] = self._buffers[p][key].tensor(like)
        return view

    @contextlib.contextmanager
    def _states_located(self, params):
        if not self._parking:
            yield
            return
        try:
            self._locate_states(params)  # a failure parks again what it had located
            yield
        finally:
            self._park_states(params)

    def _chunks(self, params):
        """`params` in the pieces a parking step locates at once, in their order (the
        order their states were reserved in: a read-back reads the spilled states just
        after it ahead, and the spill tier takes the coldest blocks, the ones stepped
        already), each at most spill_chunk_bytes of pooled states (or one parameter).
        Without parking, all of them at once. AdamW steps each parameter on its own, so
        the pieces change nothing in the results."""
        if not self._parking:
            return [list(params)]
        chunks, chunk, size = [], [], 0
        for p in params:
            nbytes = sum(4 * p.numel() for _ in self._buffers.get(p, ()))
            if chunk and size + nbytes > self._chunk_bytes:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(p)
            size += nbytes
        if chunk:
            chunks.append(chunk)
        return chunks
