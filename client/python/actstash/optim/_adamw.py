"""OffloadAdamW: torch's AdamW with its states in actstashd's pool.

    stash = actstash.connect()
    opt = actstash.optim.OffloadAdamW(model.parameters(), lr=1e-3)  # stash=: which session
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
from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from actstash import _connect, _hooks
from actstash._errors import StashError, StashFull
from actstash.optim._device_path import _DevicePath, _drain
from actstash.optim._masters import _LOW_PRECISION, _MASTER, _MasterWeights
from actstash.optim._pool_states import _PooledStates, _PoolBuffer
from actstash.optim._stepping import _MOMENTS, _scalar_dtype, _Stepping


class OffloadAdamW(_PooledStates, _MasterWeights, _DevicePath, _Stepping, torch.optim.AdamW):
    # GradScaler.step() then leaves the gradients scaled and sets grad_scale and
    # found_inf on the optimizer (as for torch's fused AdamW): step() unscales the
    # copies it steps with, so that the device path's copies made during backward stay
    # valid (GradScaler's own unscale_ changes gradients without a version bump).
    _step_supports_amp_scaling = True

    def __new__(cls, *args, **kwargs):
        # The stash was the second positional argument before it became a keyword:
        # say so, rather than take it for lr (or fail on "multiple values for lr").
        if len(args) > 1 and (isinstance(args[1], _hooks.Stash) or hasattr(args[1], "reserve")):
            raise TypeError("OffloadAdamW(params, stash, ...) is now OffloadAdamW(params, "
                            "lr=..., stash=stash): the stash is a keyword argument, and "
                            "without one the process's connection (actstash.connect()) is used")
        return super().__new__(cls)

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, stash: Any = None,
                 mode: str = "exact", fraction: float = 1.0, threads: Optional[int] = None,
                 spill: Optional[bool] = None, spill_chunk_bytes: Optional[int] = None,
                 _copies: Any = None, **kwargs: Any) -> None:
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
        if stash is None:
            stash = _connect.process_stash()
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
            self._copies = _hooks.CudaCopies(params[0].device)
        if not client.attached:
            raise StashError("OffloadAdamW: the states go to leased pool memory, which needs "
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
        # The device path: parameter -> its host copy in the pool, its gradient's host copy
        # in the pool, and (event, gradient, version) of that gradient's copy in flight.
        self._host: Dict[Any, Any] = {}
        self._host_grads: Dict[Any, Any] = {}
        self._pending: Dict[Any, Any] = {}
        self._hooks = []
        # Pooled parameter -> {state key: its _PoolBuffer}; the buffers' views made so far
        # ((parameter, key) -> view; a parked buffer's view is stale until located again).
        self._buffers: Dict[Any, Dict[str, _PoolBuffer]] = {}
        self._views: Dict[Any, Any] = {}
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
        except StashFull as full:
            self.state.clear()
            self._pooled = []
            self._masters = {}
            self._host, self._host_grads = {}, {}
            self._buffers, self._views = {}, {}
            del buffers  # every reservation goes back with its views
            raise StashFull(
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

    def zero_grad(self, *args, **kwargs):  # torch's default set_to_none, whichever it is
        super().zero_grad(*args, **kwargs)
        self._pending.clear()  # those copies are of gradients that are gone or zeroed

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

    def __enter__(self) -> OffloadAdamW:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
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
