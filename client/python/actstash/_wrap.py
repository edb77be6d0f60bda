"""actstash.wrap: apply offload and/or checkpointing to chosen submodules."""
import functools

import torch

from actstash._checkpoint import checkpoint

_MODES = ("offload", "checkpoint", "checkpoint+offload")


def _select(model, blocks):
    if blocks is None:
        raise ValueError("wrap: say which blocks, e.g. blocks=MyBlock or blocks=model.layers")
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and
                                    all(isinstance(b, type) for b in blocks)):
        return [m for m in model.modules() if isinstance(m, blocks)]
    if isinstance(blocks, torch.nn.Module):
        return list(blocks.children()) if isinstance(blocks, torch.nn.ModuleList) else [blocks]
    if callable(blocks):
        return [m for m in model.modules() if blocks(m)]
    return list(blocks)


def wrap(model, stash, blocks=None, mode="checkpoint+offload", min_bytes=64 << 10):
    """Makes each selected block offload its saved tensors ("offload"), recompute its
    interior ("checkpoint"), or recompute its interior and offload its inputs
    ("checkpoint+offload"). blocks: a module class (or tuple), a ModuleList, a
    predicate on modules, or modules. The model's parameters and buffers are never
    offloaded. Returns the model; unwrap(model) undoes it."""
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}")
    if stash is None and mode != "checkpoint":
        raise ValueError(f"mode {mode!r} needs a stash")
    if stash is not None:
        stash.keep(model)
    selected = _select(model, blocks)
    if not selected:
        raise ValueError("wrap: no block matched")
    for block in selected:
        if getattr(block, "_actstash_forward", None) is not None:
            continue  # already wrapped
        original = block.forward
        block._actstash_forward = original

        if mode == "offload":
            def forward(*args, _original=original, **kwargs):
                with stash.offload(min_bytes=min_bytes):
                    return _original(*args, **kwargs)
        else:
            boundary_stash = stash if mode == "checkpoint+offload" else None

            def forward(*args, _original=original, _stash=boundary_stash, **kwargs):
                if not torch.is_grad_enabled():
                    return _original(*args, **kwargs)  # nothing to save, nothing to recompute
                return checkpoint(_original, *args, stash=_stash, min_bytes=min_bytes, **kwargs)

        block.forward = functools.wraps(original)(forward)
    return model


def unwrap(model):
    """Restores the forward of every block wrap() changed."""
    for block in model.modules():
        original = getattr(block, "_actstash_forward", None)
        if original is not None:
            block.forward = original
            del block._actstash_forward
    return model
