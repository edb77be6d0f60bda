"""actstash.checkpoint: torch.utils.checkpoint(use_reentrant=False) semantics,
with the boundary inputs offloaded to the stash instead of held in-process.

Deliberate difference: none in results. The inputs live in actstashd between
forward and recomputation (torch keeps them in the trainer); inputs that are
parameters, smaller than min_bytes, or not tensors are kept as torch keeps
them. RNG state and autocast state are captured and replayed as torch does.
"""
import weakref

import torch
from torch.utils.checkpoint import get_device_states, set_device_states


class _Holder:
    pass


def _autocast_kwargs():
    gpu = {"enabled": torch.is_autocast_enabled(),
           "dtype": torch.get_autocast_gpu_dtype(),
           "cache_enabled": torch.is_autocast_cache_enabled()}
    cpu = {"enabled": torch.is_autocast_cpu_enabled(),
           "dtype": torch.get_autocast_cpu_dtype(),
           "cache_enabled": torch.is_autocast_cache_enabled()}
    return gpu, cpu


def checkpoint(function, *args, stash=None, preserve_rng_state=True, min_bytes=0, **kwargs):
    """Runs function(*args, **kwargs) without saving its interior for backward; the
    interior is recomputed when backward needs it. With `stash`, the tensor inputs
    (the boundary) are offloaded until then."""
    gpu_autocast, cpu_autocast = _autocast_kwargs()
    if preserve_rng_state:
        fwd_cpu_state = torch.get_rng_state()
        had_cuda_in_fwd = bool(torch.cuda._initialized)
        if had_cuda_in_fwd:
            fwd_gpu_devices, fwd_gpu_states = get_device_states(*args)

    # The boundary: tensors go to the stash; the closure keeps only handles.
    boundary = []
    for a in args:
        if stash is not None and isinstance(a, torch.Tensor) and _offloadable(stash, a, min_bytes):
            boundary.append(("stored", stash._store(a.detach()), a.requires_grad))
        else:
            boundary.append(("kept", a, None))

    def inputs():
        restored = []
        for kind, value, requires_grad in boundary:
            if kind == "kept":
                restored.append(value)
            else:
                t = stash._unpack(value)
                # Same requires_grad as in forward: it decides what autograd saves.
                restored.append(t.detach().requires_grad_(requires_grad))
        return restored

    storage = weakref.WeakKeyDictionary()
    weak_holders = []

    def pack(x):
        holder = _Holder()
        weak_holders.append(weakref.ref(holder))
        return holder

    def unpack(holder):
        if len(storage) == 0:
            counter = 0

            def inner_pack(inner):
                nonlocal counter
                counter += 1
                if weak_holders[counter - 1]() is None:
                    return
                storage[weak_holders[counter - 1]()] = inner.detach()

            def inner_unpack(packed):
                raise RuntimeError("actstash.checkpoint: backward through a tensor that was "
                                   "never exposed")

            rng_devices = fwd_gpu_devices if preserve_rng_state and had_cuda_in_fwd else []
            with torch.random.fork_rng(devices=rng_devices, enabled=preserve_rng_state):
                if preserve_rng_state:
                    torch.set_rng_state(fwd_cpu_state)
                    if had_cuda_in_fwd:
                        set_device_states(fwd_gpu_devices, fwd_gpu_states)
                recompute_args = inputs()
                with torch.enable_grad(), \
                        torch.cuda.amp.autocast(**gpu_autocast), \
                        torch.cpu.amp.autocast(**cpu_autocast), \
                        torch.autograd.graph.saved_tensors_hooks(inner_pack, inner_unpack):
                    function(*recompute_args, **kwargs)
        if holder not in storage:
            raise RuntimeError(
                "actstash.checkpoint: a saved tensor was read twice without recomputation in "
                "between (as torch.utils.checkpoint, this is not supported)")
        return storage[holder]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        output = function(*args, **kwargs)
        if torch.cuda._initialized and preserve_rng_state and not had_cuda_in_fwd:
            raise RuntimeError("CUDA was initialized inside a checkpointed forward; "
                               "initialize it before (as torch.utils.checkpoint requires)")
    return output


def _offloadable(stash, t, min_bytes):
    previous = stash._min_bytes
    stash._min_bytes = min_bytes
    try:
        return stash._should_offload(t)
    finally:
        stash._min_bytes = previous
