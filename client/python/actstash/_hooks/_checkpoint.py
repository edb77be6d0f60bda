"""actstash.checkpoint: torch.utils.checkpoint(use_reentrant=False) semantics,
with the boundary inputs offloaded to the stash instead of held in-process.

Deliberate difference: none in results. The inputs live in actstashd between
forward and recomputation (torch keeps them in the trainer); inputs that are
parameters, smaller than min_bytes, or not tensors are kept as torch keeps
them. RNG state and autocast state are captured and replayed as torch does.

Selective checkpointing (context_fn from torch's
create_selective_checkpoint_contexts): what the policy saves is cached by torch
outside the autograd graph. With a stash, those tensors go to the stash too
(respect_saved_tensors_hooks defaults to True then); without one, torch's rule
applies (the hooks around the checkpoint, if asked). The hooks this function
pushes are marked as checkpoint-internal the way torch marks its own, so SAC
never routes a cached tensor into them.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from actstash._native import lib as _lib


class _Holder:
    pass


def _autocast_kwargs(device_type):
    """The autocast state of `device_type` ("cuda" or "cpu"), to re-enter in recomputation."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4: per-device API, old one deprecated
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
    elif device_type == "cuda":
        enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    else:
        enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    return {"enabled": enabled, "dtype": dtype, "cache_enabled": torch.is_autocast_cache_enabled()}


class _StopRecomputation(Exception):
    """Raised by the recomputation's pack hook once every saved tensor is back
    (early_stop): the rest of the function need not run."""


def _torch_checkpoint_takes(keyword):
    try:
        return keyword in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    except (TypeError, ValueError):
        return False


# torch >= 2.9 takes early_stop= (and its set_checkpoint_early_stop global is None
# unless set); 2.0-2.8 have only the global, True by default.
_TORCH_EARLY_STOP_KEYWORD = _torch_checkpoint_takes("early_stop")


def _early_stop(requested):
    """torch's set_checkpoint_early_stop context overrides the keyword, as in torch; on
    a torch without the keyword only its False (the global's default is True) does."""
    forced = getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None)
    if forced is None or (forced and not _TORCH_EARLY_STOP_KEYWORD):
        return requested
    return forced


def _user_hooks_outside():
    """The (pack, unpack) saved-tensor hooks a SavedVariable made now would use, skipping
    checkpoint-internal ones (torch >= 2.14's rule), or None."""
    find = getattr(torch.utils.checkpoint, "_current_user_saved_tensors_hooks", None)
    return find() if find is not None else None


@contextlib.contextmanager
def _internal_hooks(pack, unpack, user_hooks):
    """saved_tensors_hooks(pack, unpack) marked as checkpoint-internal: torch's selective
    checkpointing looks past them to `user_hooks` (the hooks that see what SAC caches).
    The mark is held only while the hooks are pushed, as torch does: the graph keeps
    pack alive, and a lasting reference to the user's hooks could leak them."""
    pack._checkpoint_internal = True
    pack._user_hooks = user_hooks
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        del pack._user_hooks


def _set_respect_hooks(forward_context, respect):
    """Tells torch's SAC caching mode (context_fn's first context) whether what it
    caches goes through the user's hooks (torch >= 2.14; ignored where absent)."""
    if hasattr(forward_context, "respect_saved_tensors_hooks"):
        forward_context.respect_saved_tensors_hooks = respect


def compiling():
    """True while torch.compile (dynamo) traces the caller."""
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()


def _traced_checkpoint(function, args, kwargs, stash, min_bytes, context_fn, determinism_check,
                       debug, preserve_rng_state, early_stop):
    """Under torch.compile: torch.utils.checkpoint, which dynamo traces as one
    higher-order op (the compiled backward recomputes what the partitioner chose),
    with the stash's hooks around it, which the compiled function's saved tensors (the
    region's inputs, and what the partitioner saves) go through at run time. The
    eager path cannot be traced: its hooks are Python closures that recompute in
    backward, outside the compiled graph, and would save another set of tensors."""
    scope = stash.offload(min_bytes=min_bytes) if stash is not None else contextlib.nullcontext()
    extra = {} if context_fn is None else {"context_fn": context_fn}
    if _TORCH_EARLY_STOP_KEYWORD:  # else it would reach the function
        extra["early_stop"] = early_stop
    with scope:
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, determinism_check=determinism_check,
            debug=debug, preserve_rng_state=preserve_rng_state, **extra, **kwargs)


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: Optional[bool] = None,
               context_fn: Optional[Callable[[], Any]] = None,
               determinism_check: str = "default", debug: bool = False,
               preserve_rng_state: bool = True, early_stop: bool = True,
               respect_saved_tensors_hooks: Optional[bool] = None, stash: Any = None,
               min_bytes: Optional[int] = None, _observe: Any = None, **kwargs: Any) -> Any:
    """Runs function(*args, **kwargs) without saving its interior for backward; the
    interior is recomputed when backward needs it. With `stash`, the tensor inputs
    (the boundary, positional and keyword) are offloaded until then.

    torch.utils.checkpoint's keywords: use_reentrant (None or False; this is the
    non-reentrant form, True is refused), preserve_rng_state, context_fn (a function
    returning two context managers: the forward runs in the first, the recomputation in
    the second), determinism_check ("default": the recomputation must save tensors of the
    forward's shapes, dtypes and devices, else RuntimeError; "none"), debug (accepted,
    no effect), early_stop (the recomputation stops once every saved tensor is back;
    torch's set_checkpoint_early_stop overrides it), respect_saved_tensors_hooks
    (selective checkpointing: whether what the policy saves goes through saved-tensor
    hooks; None means True with `stash` (the cached tensors go to the stash) and
    torch's default without). min_bytes: boundary inputs below it stay in the trainer
    (default 64 KiB, the engine's default_min_bytes, as for Stash.offload and wrap).
    Other keyword arguments go to `function`, as in torch."""
    if min_bytes is None:
        min_bytes = _lib.DEFAULT_MIN_BYTES
    if use_reentrant:
        raise ValueError("actstash.checkpoint has the semantics of torch.utils.checkpoint("
                         "use_reentrant=False); use_reentrant=True is not supported")
    if compiling():
        return _traced_checkpoint(function, args, kwargs, stash, min_bytes, context_fn,
                                  determinism_check, debug, preserve_rng_state, early_stop)
    if determinism_check not in ("default", "none"):
        raise ValueError("determinism_check should be one of ['default', 'none'], but got "
                         f"{determinism_check}")
    if context_fn is None:
        forward_context, recompute_context = contextlib.nullcontext(), contextlib.nullcontext()
    else:
        forward_context, recompute_context = context_fn()
    if respect_saved_tensors_hooks is None and stash is not None:
        respect_saved_tensors_hooks = True
    _set_respect_hooks(forward_context, respect_saved_tensors_hooks)
    stop_early = _early_stop(early_stop)
    gpu_autocast, cpu_autocast = _autocast_kwargs("cuda"), _autocast_kwargs("cpu")
    if preserve_rng_state:
        fwd_cpu_state = torch.get_rng_state()
        had_cuda_in_fwd = bool(torch.cuda._initialized)
        if had_cuda_in_fwd:
            fwd_gpu_devices, fwd_gpu_states = get_device_states(*args, *kwargs.values())

    # The boundary: tensors go to the stash; the closure keeps only handles.
    def stash_input(a):
        if stash is not None and isinstance(a, torch.Tensor):
            packed = stash._pack(a, min_bytes, boundary=True)
            if packed is not a:
                return ("stored", packed, a.requires_grad)
        return ("kept", a, None)

    boundary = [stash_input(a) for a in args]
    keyword_boundary = {k: stash_input(v) for k, v in kwargs.items()}

    def restore(kind, value, requires_grad):
        if kind == "kept":
            return value
        t = stash._unpack(value, check_version=False)  # fn may have changed it in place
        # Same requires_grad as in forward: it decides what autograd saves.
        return t.detach().requires_grad_(requires_grad)

    def inputs():
        return ([restore(*b) for b in boundary],
                {k: restore(*b) for k, b in keyword_boundary.items()})

    check = determinism_check == "default"
    forward_meta = []

    storage: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
    weak_holders = []

    def pack(x):
        if _observe is not None:
            _observe(x)  # the automatic plan's profiler: what keeping would hold
        if check:
            forward_meta.append((x.shape, x.dtype, x.device))
        holder = _Holder()
        weak_holders.append(weakref.ref(holder))
        return holder

    def unpack(holder):
        if len(storage) == 0:
            counter = 0

            def inner_pack(inner):
                nonlocal counter
                counter += 1
                if check and (counter > len(forward_meta) or forward_meta[counter - 1] !=
                              (inner.shape, inner.dtype, inner.device)):
                    raise RuntimeError(
                        "actstash.checkpoint: recomputed values differ in metadata from the "
                        f"forward pass (saved tensor {counter - 1}: recomputed "
                        f"{(tuple(inner.shape), inner.dtype, inner.device)}, forward "
                        f"{_describe(forward_meta, counter - 1)}); pass "
                        "determinism_check='none' to skip this check")
                if weak_holders[counter - 1]() is not None:
                    storage[weak_holders[counter - 1]()] = inner.detach()
                if stop_early and counter == len(weak_holders):
                    stopped[0] = True
                    raise _StopRecomputation()

            def inner_unpack(packed):
                raise RuntimeError("actstash.checkpoint: backward through a tensor that was "
                                   "never exposed")

            rng_devices = fwd_gpu_devices if preserve_rng_state and had_cuda_in_fwd else []
            with torch.random.fork_rng(devices=rng_devices, enabled=preserve_rng_state):
                if preserve_rng_state:
                    torch.set_rng_state(fwd_cpu_state)
                    if had_cuda_in_fwd:
                        set_device_states(fwd_gpu_devices, fwd_gpu_states)
                recompute_args, recompute_kwargs = inputs()
                stopped = [False]
                try:
                    with torch.enable_grad(), recompute_context, \
                            torch.autocast("cuda", **gpu_autocast), \
                            torch.autocast("cpu", **cpu_autocast), \
                            _internal_hooks(inner_pack, inner_unpack, None):
                        function(*recompute_args, **recompute_kwargs)
                except _StopRecomputation:
                    pass
                except RuntimeError as error:
                    # torch 1.13 re-raises a hook's exception as a RuntimeError naming
                    # its type; anything else (a context's exit failing) goes on.
                    if not (stopped[0] and "_StopRecomputation" in str(error)):
                        raise
        if holder not in storage:
            raise RuntimeError(
                "actstash.checkpoint: a saved tensor was read twice without recomputation in "
                "between (as torch.utils.checkpoint, this is not supported)")
        return storage[holder]

    # What SAC caches goes where a saved tensor here would go without this
    # checkpoint: to the stash when there is one, else to the hooks around it.
    if stash is not None:
        # Stored synchronously (as the boundary): SAC caches an alias of the op's
        # output, which the function may change in place after it was cached.
        user_hooks = (lambda x: stash._pack(x, min_bytes, boundary=True), stash._unpack)
    else:
        user_hooks = _user_hooks_outside()
    with _internal_hooks(pack, unpack, user_hooks), forward_context:
        output = function(*args, **kwargs)
        if torch.cuda._initialized and preserve_rng_state and not had_cuda_in_fwd:
            raise RuntimeError("CUDA was initialized inside a checkpointed forward; "
                               "initialize it before (as torch.utils.checkpoint requires)")
    return output


# A transformers layer appends its keys and values to the cache it is given: a
# recomputation would append them again (keys of twice the length). transformers
# turns caching off itself when it checkpoints a layer (GradientCheckpointingLayer,
# or a None passed by position, as GPT-2 does); a layer actstash recomputes gets the
# same.
_CACHE_KEYWORDS = ("past_key_value", "past_key_values", "layer_past")


def _is_cache(value):
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


def without_caches(args, kwargs):
    """(args, kwargs) of a block call that will be recomputed: no key/value cache
    (by position or keyword) and use_cache=False, as transformers does for its own
    checkpointed layers."""
    if any(_is_cache(a) for a in args):
        args = tuple(None if _is_cache(a) else a for a in args)
    if any(k in kwargs for k in _CACHE_KEYWORDS + ("use_cache",)) or \
            any(_is_cache(v) for v in kwargs.values()):
        kwargs = {k: None if (k in _CACHE_KEYWORDS or _is_cache(v)) else v
                  for k, v in kwargs.items()}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
    return args, kwargs


def _describe(meta, index):
    if index >= len(meta):
        return "nothing (the forward saved fewer tensors)"
    shape, dtype, device = meta[index]
    return str((tuple(shape), dtype, device))
