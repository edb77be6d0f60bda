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
per step; amsgrad and maximize are not offered there.

Parameters must be fp32, dense, contiguous and on the CPU (a CPU trainer; the
GPU path, with fp32 master weights for bf16 models, is not built yet).
`fraction` < 1 keeps the states of the last parameters (by bytes) in the
process, as Megatron's optimizer offload fraction does.
"""
import ctypes

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


# What torch's AdamW keeps per parameter beside its step.
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _scalar_dtype():
    # torch's own choice for a step count (torch.optim.optimizer, 2.x), or 1.13's.
    import importlib
    module = importlib.import_module("torch.optim.optimizer")
    get = getattr(module, "_get_scalar_dtype", None)
    return get() if get is not None else torch.get_default_dtype()


class OffloadAdamW(torch.optim.AdamW):
    def __init__(self, params, stash, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, mode="exact", fraction=1.0, threads=None, **kwargs):
        if mode not in ("exact", "fast"):
            raise ValueError("mode must be 'exact' or 'fast'")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("fraction must be in [0, 1]")
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
        _check(params)
        if not client.attached:
            raise _lib.StashError("OffloadAdamW: the states go to leased pool memory, which needs "
                                  "an attached client (a local daemon on a Unix socket): "
                                  + str(client.attach_error))
        keys = _MOMENTS + (("max_exp_avg_sq",) if amsgrad else ())
        total = sum(p.numel() * p.element_size() for p in params)
        budget = fraction * total
        self._pooled = []
        taken = 0
        buffers = []
        try:
            for p in params:
                nbytes = p.numel() * p.element_size()
                if taken + nbytes > budget + 0.5:
                    continue
                taken += nbytes
                state = {"step": torch.tensor(0.0, dtype=_scalar_dtype())}
                for key in keys:
                    buffer = _PoolBuffer(client, max(nbytes, 1))
                    buffers.append(buffer)
                    state[key] = buffer.tensor(p).zero_()
                self.state[p] = state
                self._pooled.append(p)
        except _lib.StashFull as full:
            self.state.clear()
            self._pooled = []
            del buffers  # every reservation goes back with its views
            raise _lib.StashFull(
                f"OffloadAdamW: the states need {len(keys) * budget:,.0f} bytes of pool memory "
                f"({len(keys)} per byte of {budget:,.0f} bytes of parameters); the session "
                f"cannot hold them ({full}); nothing was kept") from None

    @property
    def offloaded_bytes(self):
        """Bytes of this optimizer's state in the pool."""
        return sum(t.numel() * t.element_size() for p in self._pooled
                   for key, t in self.state[p].items() if key != "step")

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, then the loaded moments go into this optimizer's pool
        buffers (a state saved by torch.optim.AdamW loads too)."""
        pool = {p: {k: v for k, v in self.state[p].items() if k != "step"} for p in self._pooled}
        super().load_state_dict(state_dict)
        for p, views in pool.items():
            state = self.state[p]
            if "step" in state:  # torch 2.x may keep the caller's tensor: not stepped in place
                state["step"] = state["step"].clone()
            for key, view in views.items():
                if key in state:
                    view.copy_(state[key])
                else:
                    view.zero_()
                state[key] = view

    @torch.no_grad()
    def step(self, closure=None):
        if self._mode == "exact":
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            buckets = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("OffloadAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    for key in _MOMENTS:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                buckets.setdefault(int(state["step"].item()), []).append((p, grad, state))
            for step, items in buckets.items():
                n = len(items)
                arrays = [(ctypes.c_size_t * n)() for _ in range(4)]
                sizes = (ctypes.c_uint64 * n)()
                for i, (p, grad, state) in enumerate(items):
                    arrays[0][i] = p.data_ptr()
                    arrays[1][i] = grad.data_ptr()
                    arrays[2][i] = state["exp_avg"].data_ptr()
                    arrays[3][i] = state["exp_avg_sq"].data_ptr()
                    sizes[i] = p.numel()
                code = _lib.adamw_step(n, *arrays, sizes, float(group["lr"]), float(beta1),
                                       float(beta2), float(group["eps"]),
                                       float(group["weight_decay"]), step, int(self._threads))
                if code:
                    _lib.raise_for(code)
        return loss

    def close(self):
        """Moves the states into the process and gives the pool memory back; the
        optimizer goes on working."""
        for p in self._pooled:
            state = self.state[p]
            for key in list(state):
                if key != "step":
                    state[key] = state[key].clone()
        self._pooled = []


def _check(params):
    """Every reason the parameters cannot have pooled states, before anything is
    reserved."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError("OffloadAdamW: the parameters are on several devices ("
                         + ", ".join(sorted(str(d) for d in devices)) + "); one optimizer "
                         "per device")
    for i, p in enumerate(params):
        where = f"OffloadAdamW: parameter {i} ({tuple(p.shape)}, {p.dtype}, {p.device})"
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(where + " is sparse: not supported")
        if p.device.type != "cpu":
            raise ValueError(where + " is not on the CPU: the GPU path (states in the pool, "
                             "gradients copied to it) is not built yet")
        if p.dtype != torch.float32:
            raise ValueError(where + " is not fp32: fp32 master weights for bf16/fp16 models "
                             "are not built yet")
        if not p.is_contiguous():
            raise ValueError(where + " is not contiguous")
