"""OffloadAdamW: torch's AdamW with its states in actstashd's pool.

    stash = actstash.connect()
    opt = actstash.optim.OffloadAdamW(model.parameters(), stash, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Adam's two moments (and amsgrad's maximum) of every parameter live in leased
memory of the node's pool, under the session's quota and the node's budget,
not in the trainer's heap: stats()["optimizer_state_bytes"] counts them (and the
daemon's /metrics, actstash_optimizer_state_bytes, sums them over sessions). It is
a torch.optim.AdamW: param groups, schedulers, state_dict() and
load_state_dict() in torch's format (a run resumes with or without actstash).

mode="exact" (the default) runs torch's own AdamW (foreach=False) on those
states: parameters bitwise equal to torch.optim.AdamW(foreach=False).
mode="fast" runs actstash's multi-threaded C++ step (kernels/adamw.h): every
operation rounded on its own, so results may differ from torch's by a few ulps
per step; amsgrad and maximize are not offered there. For bf16 parameters it
reads the bf16 gradients and writes the parameters in the same pass as the
masters.

Parameters must be dense, contiguous, fp32, bf16 or fp16, all on the CPU or all
on one CUDA device. On a device (the device path), the pool also holds a host
copy of each parameter and of its gradient: as soon as a gradient is final
(register_post_accumulate_grad_hook, torch >= 2.1) it is copied to the host on a
side stream while backward goes on, and the next accumulation into it waits for
that copy on the device, not on the CPU; step() waits for the copies (copying
again what changed since, as clip_grad_norm_ changes it), steps on the host as
on a CPU trainer, and copies the new parameters back on the side stream, which
the trainer's stream waits for before the next forward. The pool is registered
with CUDA on a GPU node, so these copies are asynchronous.

A bf16 or fp16 parameter gets an fp32 master weight in the pool beside its fp32
moments (state key "master_weight"): the step runs on the master with the
gradient cast to fp32, then rounds the master into the parameter, the
mixed-precision recipe of Megatron and DeepSpeed. In the default mode that is bitwise what
torch.optim.AdamW(foreach=False) does to fp32 copies of the parameters given
the cast gradients, followed by param.copy_(master).
`fraction` < 1 keeps the states of the last parameters (by bytes) in the
process, as Megatron's optimizer offload fraction does (on a device: on the
device, stepped there by torch; fp32 parameters only).

spill=None (the default) parks the pooled states between steps when this session can
spill (the daemon has a spill tier and the client's spill setting is on; spill=True:
always; False: never): under pool pressure the tier may take them, as it takes
activations. Parked, opt.state[p] holds meta tensors of their shapes (state_dict()
gives the values, copied into the process); step() reads back what it steps,
spill_chunk_bytes at a time (default: an eighth of the pool, at most 256 MiB), in the
parameters' order, and parks them again.
"""
import contextlib
import ctypes
import weakref

import torch

from actstash import _lib


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


# What torch's AdamW keeps per parameter beside its step.
_MOMENTS = ("exp_avg", "exp_avg_sq")
# A bf16/fp16 parameter's fp32 copy, which the step updates.
_MASTER = "master_weight"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _scalar_dtype():
    # torch's own choice for a step count (torch.optim.optimizer, 2.x), or 1.13's.
    import importlib
    module = importlib.import_module("torch.optim.optimizer")
    get = getattr(module, "_get_scalar_dtype", None)
    return get() if get is not None else torch.get_default_dtype()


class OffloadAdamW(torch.optim.AdamW):
    # GradScaler.step() then leaves the gradients scaled and sets grad_scale and
    # found_inf on the optimizer (as for torch's fused AdamW): step() unscales the
    # copies it steps with, so that the device path's copies made during backward stay
    # valid (GradScaler's own unscale_ changes gradients without a version bump).
    _step_supports_amp_scaling = True

    def __init__(self, params, stash, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, mode="exact", fraction=1.0, threads=None, spill=None,
                 spill_chunk_bytes=None, _copies=None, **kwargs):
        if mode not in ("exact", "fast"):
            raise ValueError("mode must be 'exact' or 'fast'")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("fraction must be in [0, 1]")
        if spill not in (None, True, False):
            raise ValueError("spill must be None, True or False")
        for option in ("capturable", "fused", "differentiable"):
            if kwargs.get(option):
                raise ValueError(f"OffloadAdamW: {option}=True is not supported")
        if mode == "fast" and (amsgrad or kwargs.get("maximize")):
            raise ValueError("OffloadAdamW: mode='fast' offers neither amsgrad nor maximize")
        kwargs.setdefault("foreach", False)
        client = getattr(stash, "client", stash)
        if client is None:
            raise ValueError("OffloadAdamW needs a stash connected to actstashd")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, **kwargs)
        self._client = client
        self._mode = mode
        self._threads = threads if threads is not None else torch.get_num_threads()
        params = [p for group in self.param_groups for p in group["params"]]
        # The device path's copies: CUDA's for CUDA parameters; tests pass a simulated
        # device (actstash_testing.sim_device) that treats CPU parameters as on one.
        self._copies = _copies
        _check(params, simulated=_copies is not None)
        if self._copies is None and params and params[0].device.type == "cuda":
            from actstash._device_copies import CudaCopies
            self._copies = CudaCopies(params[0].device)
        if not client.attached:
            raise _lib.StashError("OffloadAdamW: the states go to leased pool memory, which needs "
                                  "an attached client (a local daemon on a Unix socket): "
                                  + str(client.attach_error))
        # Parked between steps (the spill tier may take them): by default when this
        # session can spill (the daemon has a tier, the client's spill setting is on).
        self._parking = spill if spill is not None else bool(client.can_spill)
        moments = _MOMENTS + (("max_exp_avg_sq",) if amsgrad else ())

        def keys_of(p):
            return moments + ((_MASTER,) if p.dtype in _LOW_PRECISION else ())

        # States are fp32: 4 bytes per element and key, whatever the parameter's dtype.
        need = {p: 4 * p.numel() * len(keys_of(p)) for p in params}
        if self._copies is not None:  # and the host copies of the parameter and its gradient
            need = {p: n + 2 * p.numel() * p.element_size() for p, n in need.items()}
        budget = fraction * sum(need.values())
        if spill_chunk_bytes is None and self._parking:  # small against the pool: the
            # rest may hold others' (one stats RPC, only when the pieces matter)
            spill_chunk_bytes = max(min(256 << 20, client.stats()["pool"]["total_bytes"] // 8),
                                    1)
        self._chunk_bytes = int(spill_chunk_bytes or 0)
        pooled_ones, taken = set(), 0
        for p in params:  # which are pooled, before anything is reserved
            if taken + need[p] <= budget + 0.5:
                pooled_ones.add(p)
                taken += need[p]
            elif self._copies is not None and p.dtype in _LOW_PRECISION:
                raise ValueError("OffloadAdamW: fraction < 1 with bf16/fp16 parameters on a "
                                 "device is not supported (their master weights would stay on "
                                 "the device); use fraction=1.0")
        self._pooled = []
        self._masters = {}  # bf16/fp16 parameter -> its fp32 master weight
        self._scratch = None  # their gradients cast to fp32 (_fp32_grad)
        # Each one's version counter when its master was last written into it: a
        # parameter changed since (model.load_state_dict, a manual edit) to other
        # values than its master's seeds its master again before the next step,
        # rather than being overwritten by it.
        self._versions = {}
        buffers = []
        self._host = {}        # device path: parameter -> its host copy in the pool
        self._host_grads = {}  # device path: parameter -> its gradient's host copy in the pool
        self._pending = {}     # device path: parameter -> (event, gradient, version) of its copy
        self._hooks = []
        # Pooled parameter -> {state key: its _PoolBuffer}; the buffers' views made so far
        # ((parameter, key) -> view; a parked buffer's view is stale until located again).
        self._buffers = {}
        self._views = {}
        try:
            # The device path's host copies of the parameters and gradients first, all
            # together: written during backward, they never spill, and leases they share
            # with states would keep those from spilling too.
            for p in params if self._copies is not None else ():
                if p in pooled_ones:
                    like_p = torch.empty(p.shape, dtype=p.dtype, device="meta")
                    for into in (self._host, self._host_grads):
                        buffer = _PoolBuffer(client, max(p.numel() * p.element_size(), 1))
                        buffers.append(buffer)
                        into[p] = buffer.tensor(like_p)
                    self._host[p].copy_(p.detach())
            for p in params:
                pooled = p in pooled_ones
                if not pooled and p.dtype not in _LOW_PRECISION:
                    continue  # torch creates its states at the first step
                state = {"step": torch.tensor(0.0, dtype=_scalar_dtype())}
                like = torch.empty(p.shape, dtype=torch.float32, device="meta")
                for key in keys_of(p):
                    if pooled:
                        buffer = _PoolBuffer(client, max(4 * p.numel(), 1))
                        buffers.append(buffer)
                        self._buffers.setdefault(p, {})[key] = buffer
                        state[key] = self._views[(p, key)] = buffer.tensor(like)
                    else:
                        state[key] = torch.empty(p.shape, dtype=torch.float32)
                    if key == _MASTER:
                        state[key].copy_(self._host.get(p, p).detach())
                        self._masters[p] = state[key]
                        self._versions[p] = p._version
                    else:
                        state[key].zero_()
                self.state[p] = state
                if pooled:
                    self._pooled.append(p)
                    if self._parking:  # written: the next ones may spill it
                        self._park_states([p])
        except _lib.StashFull as full:
            self.state.clear()
            self._pooled = []
            self._masters = {}
            self._host, self._host_grads = {}, {}
            self._buffers, self._views = {}, {}
            del buffers  # every reservation goes back with its views
            raise _lib.StashFull(
                f"OffloadAdamW: the states need {budget:,.0f} bytes of pool memory (fp32 "
                f"moments, master weights for bf16/fp16 parameters, and on a device the host "
                f"copies of the parameters and gradients); the session cannot hold them "
                f"({full}); nothing was kept") from None
        for p in self._host:
            self._versions[p] = p._version
            if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                before, after = self._device_hooks(p)
                self._hooks.append(p.register_hook(before))
                self._hooks.append(p.register_post_accumulate_grad_hook(after))
        if self._host:
            # Dropped with copies in flight: they finish before the pool memory goes
            # back (the buffers are freed after this runs), and the hooks go.
            weakref.finalize(self, _drain, self._copies, self._hooks)

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

    def state_dict(self):
        """torch's state_dict. While the states are parked (spill), the pooled ones are
        copied into the process, a piece at a time: the dict outlives the next step,
        which may move them."""
        saved = super().state_dict()
        if not self._parking:
            return saved
        order = [p for group in self.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}  # torch's numbering of them
        for chunk in self._chunks([p for p in order if p in self._buffers]):
            with self._states_located(chunk):
                for p in chunk:  # all of it copied: step too, which the next step bumps
                    saved["state"][index[id(p)]] = {
                        key: value.clone() if torch.is_tensor(value) else value
                        for key, value in self.state[p].items()}
        return saved

    def _device_hooks(self, p):
        """p's two hooks on the device path; they hold the optimizer weakly (a parameter
        outlives its optimizer often enough). Before: autograd is about to accumulate a
        new gradient into p.grad, which the side stream may still be copying to the host,
        so the trainer's stream waits for that copy first (the CPU does not). After
        (register_post_accumulate_grad_hook): _grad_to_host."""
        this = weakref.ref(self)

        @torch.utils.hooks.unserializable_hook
        def before(grad):
            optimizer = this()
            pending = optimizer._pending.get(p) if optimizer is not None else None
            if pending is not None:
                optimizer._copies.wait(optimizer._copies.current(), pending[0])

        @torch.utils.hooks.unserializable_hook
        def after(param):
            optimizer = this()
            if optimizer is not None and param in optimizer._host_grads and \
                    not param.grad.is_sparse:  # step() refuses those, with its message
                optimizer._grad_to_host(param)
        return before, after

    def zero_grad(self, *args, **kwargs):  # torch's default set_to_none, whichever it is
        super().zero_grad(*args, **kwargs)
        self._pending.clear()  # those copies are of gradients that are gone or zeroed

    def _grad_to_host(self, p):
        """register_post_accumulate_grad_hook: p.grad is final for this backward."""
        grad = p.grad
        self._pending[p] = (self._copy_grad(p), grad, grad._version)

    def _copy_grad(self, p):
        """Starts p.grad's copy to its host copy on the side stream, after what the
        trainer's stream has queued (which produces it); returns the copy's event."""
        c, grad = self._copies, p.grad
        side = c.side()
        c.wait(side, c.record(c.current()))
        c.keep(grad, side)
        c.copy(self._host_grads[p], grad, side)
        return c.record(side)

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, then the loaded states go into this optimizer's fp32
        buffers (the pool's, and the masters kept in the process) as they were saved, not
        cast to the parameter's dtype as torch casts them. A state saved by
        torch.optim.AdamW loads too; a bf16/fp16 parameter saved without a master weight
        gets one from the parameter."""
        # Each state key's view or tensor (pooled ones by their buffers: a parked one's
        # entry is a meta tensor of its shape until located).
        ours = {p: {k: v for k, v in self.state[p].items() if k != "step"}
                for p in set(self._pooled) | set(self._masters)}
        saved = {}  # parameter -> the state it was saved with, uncast
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for index, p in zip(saved_group["params"], group["params"]):
                if index in state_dict["state"]:
                    saved[p] = state_dict["state"][index]
        for p, views in ours.items():  # every reason to refuse, before anything is loaded
            for key, view in views.items():
                value = saved.get(p, {}).get(key)
                if torch.is_tensor(value) and value.shape != view.shape:
                    raise ValueError(f"OffloadAdamW.load_state_dict: {key} of a parameter "
                                     f"of shape {tuple(view.shape)} was saved with shape "
                                     f"{tuple(value.shape)}")
        super().load_state_dict(state_dict)
        order = [p for group in self.param_groups for p in group["params"] if p in ours]
        for chunk in self._chunks(order):
            with self._states_located(chunk):
                for p in chunk:
                    self._load_one(p, ours[p], saved.get(p, {}))

    def _load_one(self, p, views, source):
        """p's state after torch's load_state_dict: its own step tensor, and `source`'s
        values copied into p's fp32 buffers (located when parking)."""
        state = self.state[p]
        if "step" in state:  # torch 2.x may keep the caller's tensor: not stepped in place
            state["step"] = state["step"].clone()
        else:
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
        for key, view in views.items():
            if key in self._buffers.get(p, {}):
                view = self._view(p, key)
            if key in source:
                view.copy_(source[key])
            elif key == _MASTER:
                view.copy_(p.detach())
            else:
                view.zero_()
            state[key] = view
            if key == _MASTER:
                self._masters[p] = view

    def add_param_group(self, param_group):
        if hasattr(self, "_masters"):  # torch's __init__ adds the first groups
            raise ValueError("OffloadAdamW: add_param_group after construction is not "
                             "supported (the new parameters' states would not be in the "
                             "pool); build the optimizer with every group")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every reason to refuse, before anything is stepped.
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("OffloadAdamW does not support sparse gradients")
        # Set by GradScaler.step() for this step only: grad_scale when the gradients
        # are still scaled, None when its unscale_ has run (in place, no version bump).
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self.grad_scale = self.found_inf = None
        if found_inf is not None and grad_scale is None:
            self._pending.clear()  # unscaled on the device since the copies: copied again
        if found_inf is not None and float(found_inf) != 0:
            self._pending.clear()
            return loss  # an inf or NaN gradient: skipped, as GradScaler skips torch's step
        # GradScaler's unscale: each gradient times 1/scale rounded to fp32, once.
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        if self._host:
            self._step_device(inv_scale)
            return loss
        if inv_scale is not None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv_scale.to(p.grad.device))
        # What the step reads: parameters with a gradient, and masters whose parameter
        # changed (a frozen parameter's parked states stay where they are).
        params = [p for group in self.param_groups for p in group["params"]
                  if p.grad is not None or (p in self._masters and
                                            p._version != self._versions[p])]
        with self._stepping(len(params)) as stepped:
            for chunk in self._chunks(params):
                with self._states_located(chunk):
                    for p in chunk:
                        if p in self._masters and p._version != self._versions[p]:
                            self._master_follows(p, p)  # changed since its master was
                            self._versions[p] = p._version  # written into it
                    self._step_some(chunk)
                stepped.append(len(chunk))
        return loss

    def _master_follows(self, p, source):
        """p (a bf16/fp16 parameter, located when parking) changed since its master was
        written into it, to `source`'s values (p itself, or its host copy): unless that
        still holds the master rounded (the same checkpoint loaded again), the master
        follows it."""
        master = self._masters[p]
        if not torch.equal(source, master.to(p.dtype)):
            master.copy_(source)

    @contextlib.contextmanager
    def _stepping(self, total):
        """Yields a list the step appends the size of each piece it finished to. A pool
        error part way (parked states that cannot be read back: the pool stayed full, a
        spill lost) says how far the step got: the pieces before it were stepped (their
        states and step counts moved), the rest not."""
        stepped = []
        try:
            yield stepped
        except _lib.StashError as error:
            raise type(error)(f"OffloadAdamW.step: {error} (reading parked states back; "
                              f"{sum(stepped)} of {total} parameters were stepped before "
                              f"this, the others not)") from error

    def _step_some(self, params):
        """The exact or fast step of `params` alone (the groups hold only those
        meanwhile)."""
        some = set(params)
        with self._groups_kept() as kept:
            for group, members in zip(self.param_groups, kept):
                group["params"] = [p for p in members if p in some]
            if self._mode == "exact":
                self._step_exact()
            else:
                self._step_fast()

    def _step_device(self, inv_scale):
        """The device path's step: the gradients' copies to the host finished (or made
        now) and unscaled by `inv_scale` (GradScaler's, or None), the step on the host
        copies, the new parameters copied back."""
        c = self._copies
        current, side = c.current(), c.side()
        hosted = list(self._host)
        for p in hosted:
            pending, grad = self._pending.pop(p, None), p.grad
            if grad is None or (pending is not None and pending[1] is grad
                                and pending[2] == grad._version):
                continue
            # Not copied by the hook (torch < 2.1, a gradient set by hand) or changed
            # since (clip_grad_norm_).
            self._copy_grad(p)
        # A parameter changed on the device since its host copy was written into it (a
        # checkpoint loaded, a manual edit): the host copy, and its master, follow it.
        changed = [p for p in hosted if p._version != self._versions[p]]
        if changed:
            c.wait(side, c.record(current))
            for p in changed:
                c.copy(self._host[p], p.detach(), side)
        # The side stream runs in order: this covers every copy above and the previous
        # step's copies to the device, which read the host copies about to be written.
        c.sync(c.record(side))
        for p in changed:
            self._versions[p] = p._version
        if inv_scale is not None:
            for p in hosted:
                if p.grad is not None:
                    self._host_grads[p].mul_(inv_scale.cpu())
        # Back to the device (a piece at a time when parking), after the trainer's stream
        # is done with the old values (step() queues nothing on it meanwhile); the
        # trainer's stream waits for them before it runs anything more (the next
        # forward), the CPU does not.
        c.wait(side, c.record(current))
        changed = set(changed)
        stepping = [p for p in hosted if p.grad is not None or p in changed]
        try:
            with self._stepping(len(stepping)) as stepped:
                for chunk in self._chunks(stepping):
                    with self._states_located(chunk):
                        for p in changed.intersection(self._masters).intersection(chunk):
                            self._master_follows(p, self._host[p])
                        self._step_on_host(chunk)
                    for p in chunk:
                        if p.grad is not None:
                            c.copy(p.detach(), self._host[p], side)
                            self._versions[p] = p._version
                    stepped.append(len(chunk))
        finally:  # what went back to the device, however far the step got
            c.wait(current, c.record(side))
        rest = [[p for p in group["params"] if p not in self._host] for group in self.param_groups]
        if any(rest):  # fraction < 1: the others' states are on the device, torch steps them
            with self._groups_kept():
                for group, params in zip(self.param_groups, rest):
                    group["params"] = params
                self._torch_step()

    def _step_on_host(self, hosted):
        """The CPU trainer's step (exact or fast) on the host copies of `hosted`, their
        states and gradients' copies standing in for the device parameters'."""
        masters, versions = self._masters, self._versions
        host, some = self._host, set(hosted)
        with self._groups_kept() as kept:
            try:
                self._masters = {host[p]: m for p, m in masters.items() if p in some}
                self._versions = {host[p]: host[p]._version for p in hosted}
                for group, params in zip(self.param_groups, kept):
                    group["params"] = [host[p] for p in params if p in some]
                for p in hosted:
                    self.state[host[p]] = self.state[p]  # the same dict: stepped in place
                    host[p].grad = self._host_grads[p] if p.grad is not None else None
                if self._mode == "exact":
                    self._step_exact()
                else:
                    self._step_fast()
            finally:
                for p in hosted:
                    host[p].grad = None
                    self.state.pop(host[p], None)
                self._masters, self._versions = masters, versions

    @contextlib.contextmanager
    def _groups_kept(self):
        """Yields each group's parameter list; the body may set group["params"] to
        others for a call, and the lists are put back however it ends."""
        kept = [group["params"] for group in self.param_groups]
        try:
            yield kept
        finally:
            for group, params in zip(self.param_groups, kept):
                group["params"] = params

    def _torch_step(self):
        """torch's AdamW.step without the hooks torch wraps around it (2.x runs the step
        hooks in that wrapper once any AdamW was made: they belong to opt.step(), which
        runs them once, not to each call here)."""
        step = torch.optim.AdamW.step
        if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
            step = step.__wrapped__
        return step(self)

    def _step_exact(self):
        """torch's own step: on the fp32 parameters at once, then on each master alone
        (the group holding only it, its gradient cast to fp32 for that while)."""
        if not self._masters:
            return self._torch_step()
        with self._groups_kept() as kept:
            for group, params in zip(self.param_groups, kept):
                group["params"] = [p for p in params if p not in self._masters]
            self._torch_step()
            for group in self.param_groups:
                group["params"] = []
            for group, params in zip(self.param_groups, kept):
                for p in params:
                    master = self._masters.get(p)
                    if master is None or p.grad is None:
                        continue
                    group["params"] = [master]
                    try:
                        self.state[master] = self.state[p]  # the same dict: stepped in place
                        master.grad = self._fp32_grad(p)
                        self._torch_step()
                    finally:
                        master.grad = None
                        self.state.pop(master, None)
                        group["params"] = []
                    p.copy_(master)
                    self._versions[p] = p._version

    def _step_fast(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            buckets = {}  # (step, bf16) -> [(param, fp32 target, gradient, state)]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    for key in _MOMENTS:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                master = self._masters.get(p)
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                bf16 = master is not None and p.dtype == torch.bfloat16
                buckets.setdefault((int(state["step"].item()), bf16), []).append(
                    (p, p if master is None else master, grad, state))
            for (step, bf16), items in buckets.items():
                self._fast_bucket(group, step, bf16, items, beta1, beta2)

    def _fast_bucket(self, group, step, bf16, items, beta1, beta2):
        """One C++ step over tensors at the same step count. bf16 parameters: the kernel
        reads their gradients and writes them beside their masters. fp16 ones: the
        gradient is cast into a scratch buffer, the master rounded into the parameter
        after."""
        hyper = (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                 float(group["weight_decay"]), step, int(self._threads))
        for p, target, _, state in items:  # the kernel reads and writes fp32 arrays
            if target.dtype != torch.float32 or state["exp_avg"].dtype != torch.float32:
                raise RuntimeError(f"OffloadAdamW: a {p.dtype} parameter without an fp32 "
                                   "master in the fast step")
        if bf16 or all(target is p for p, target, _, _ in items):
            n = len(items)
            arrays = [(ctypes.c_size_t * n)() for _ in range(5)]
            sizes = (ctypes.c_uint64 * n)()
            for i, (p, target, grad, state) in enumerate(items):
                arrays[0][i] = target.data_ptr()
                arrays[1][i] = grad.data_ptr()
                arrays[2][i] = state["exp_avg"].data_ptr()
                arrays[3][i] = state["exp_avg_sq"].data_ptr()
                arrays[4][i] = p.data_ptr()
                sizes[i] = target.numel()
            if bf16:
                code = _lib.adamw_step_bf16(n, *arrays, sizes, *hyper)
            else:
                code = _lib.adamw_step(n, *arrays[:4], sizes, *hyper)
            if code:
                _lib.raise_for(code)
            # The kernel writes bf16 parameters without a version bump: the
            # versions step() recorded stay right.
            return
        for p, target, grad, state in items:  # one at a time: one scratch gradient
            if target is not p:
                grad = self._fp32_grad(p)
            code = _lib.adamw_step(1, *[(ctypes.c_size_t * 1)(t.data_ptr()) for t in (
                target, grad, state["exp_avg"], state["exp_avg_sq"])],
                (ctypes.c_uint64 * 1)(target.numel()), *hyper)
            if code:
                _lib.raise_for(code)
            if target is not p:
                p.copy_(target)
                self._versions[p] = p._version

    def _fp32_grad(self, p):
        """A bf16/fp16 parameter's gradient cast to fp32, in a scratch buffer the size of
        the largest master (kept: a fresh buffer each step would fault its pages in
        again); valid until the next call. step() refused sparse gradients."""
        if self._scratch is None or self._scratch.numel() < p.numel():
            self._scratch = torch.empty(max(m.numel() for m in self._masters.values()),
                                        dtype=torch.float32)
        out = self._scratch[:p.numel()].view(p.shape)
        out.copy_(p.grad)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Moves the states (and on the device path the host copies) into the process and
        gives the pool memory back; the optimizer goes on working. `with
        OffloadAdamW(...) as opt:` closes it at the end of the block."""
        if self._host:
            self._copies.sync(self._copies.record(self._copies.side()))
            self._pending.clear()
            self._host = {p: t.clone() for p, t in self._host.items()}
            self._host_grads = {p: t.clone() for p, t in self._host_grads.items()}
        for chunk in self._chunks(self._pooled):  # when parking, a piece in memory at a time
            if self._parking:
                self._locate_states(chunk)
            for p in chunk:
                state = self.state[p]
                for key in list(state):
                    if key != "step":
                        state[key] = state[key].clone()
                if p in self._masters:
                    self._masters[p] = state[_MASTER]  # the step updates the one saved
                # The piece's buffers go back now (nothing else views them), before the
                # next piece is read back.
                for key in self._buffers.pop(p, {}):
                    self._views.pop((p, key), None)
        self._parking = False
        self._pooled = []


def _drain(copies, hooks):
    for handle in hooks:
        handle.remove()
    copies.sync(copies.record(copies.side()))


def _check(params, simulated=False):
    """Every reason the parameters cannot have pooled states, before anything is
    reserved. `simulated`: CPU parameters stand for a device's (tests)."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError("OffloadAdamW: the parameters are on several devices ("
                         + ", ".join(sorted(str(d) for d in devices)) + "); one optimizer "
                         "per device")
    for i, p in enumerate(params):
        where = f"OffloadAdamW: parameter {i} ({tuple(p.shape)}, {p.dtype}, {p.device})"
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(where + " is sparse: not supported")
        if p.device.type not in ("cpu", "cuda") or (simulated and p.device.type != "cpu"):
            raise ValueError(where + " is neither on the CPU nor on a CUDA device")
        if p.dtype not in (torch.float32,) + _LOW_PRECISION:
            raise ValueError(where + " is not fp32, bf16 or fp16")
        if not p.is_contiguous():
            raise ValueError(where + " is not contiguous")
