"""OffloadAdamW's steps: mode="exact" runs torch's own AdamW (foreach=False) on the
pooled states, mode="fast" actstash's C++ kernel (kernels/adamw.h); either on the
parameters the groups hold for the call (_groups_kept), a piece at a time when
parking (_stepping says how far a failed step got).
"""
import contextlib
import ctypes

import torch

from actstash._errors import StashError
from actstash._native import lib as _lib

# What torch's AdamW keeps per parameter beside its step.
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _scalar_dtype():
    # torch's own choice for a step count (torch.optim.optimizer, 2.x), or 1.13's.
    import importlib
    module = importlib.import_module("torch.optim.optimizer")
    get = getattr(module, "_get_scalar_dtype", None)
    return get() if get is not None else torch.get_default_dtype()


class _Stepping:
    """A mixin of OffloadAdamW: the exact and the fast step."""

    @contextlib.contextmanager
    def _stepping(self, total):
        """Yields a list the step appends the size of each piece it finished to. A pool
        error part way (parked states that cannot be read back: the pool stayed full, a
        spill lost) says how far the step got: the pieces before it were stepped (their
        states and step counts moved), the rest not."""
        stepped = []
        try:
            yield stepped
        except StashError as error:
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
