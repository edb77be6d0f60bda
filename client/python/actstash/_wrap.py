"""actstash.wrap: apply offload and/or checkpointing to chosen submodules."""
import functools

import torch

from actstash._checkpoint import checkpoint

_MODES = ("offload", "checkpoint", "checkpoint+offload")
_POLICIES = ("manual", "auto")


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


def _repeated_blocks(model):
    """The children of the model's largest ModuleList (most children, then most
    parameters): the repeated blocks of a transformer."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError("wrap(policy='auto'): the model has no ModuleList to take blocks "
                         "from; say which blocks, e.g. blocks=MyBlock")
    return max(lists, key=lambda m: (len(m), sum(p.numel() for p in m.parameters())))


def wrap(model, stash, blocks=None, mode="checkpoint+offload", min_bytes=64 << 10,
         policy="manual", budget=None, memory_limit=None):
    """Makes each selected block offload its saved tensors ("offload"), recompute its
    interior ("checkpoint"), or recompute its interior and offload its inputs
    ("checkpoint+offload"). blocks: a module class (or tuple), a ModuleList, a
    predicate on modules, or modules. The model's parameters and buffers are never
    offloaded. Returns the model; unwrap(model) undoes it.

    policy="auto" chooses per block among keep, offload, checkpoint and
    checkpoint+offload (`mode` is then unused): the first step of each input shape
    is measured, the plan of least predicted step time whose peak memory fits
    `budget` is applied from the next step on, and checked by measuring the step
    after. budget: bytes, a size like "6GiB", or a fraction of the GPU's free memory
    (CUDA) or of memory_limit (CPU; default: the node's available memory). It bounds
    the memory a step adds from the first block's forward to the end of backward
    (saved activations and the transients of forward and backward). blocks=None
    takes the children of the model's largest ModuleList. stash.plan() shows the
    plan; actstash.BudgetError is raised from forward when no plan fits."""
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {_POLICIES}")
    if policy == "auto":
        return _wrap_auto(model, stash, blocks, min_bytes, budget, memory_limit)
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


def _wrap_auto(model, stash, blocks, min_bytes, budget, memory_limit):
    from actstash._auto import AutoPlanner
    if stash is None:
        raise ValueError("policy='auto' needs a stash")
    if getattr(model, "_actstash_planner", None) is not None:
        raise ValueError("the model is already wrapped with policy='auto'; unwrap it first")
    selected = _select(model, _repeated_blocks(model) if blocks is None else blocks)
    if not selected:
        raise ValueError("wrap: no block matched")
    if any(getattr(b, "_actstash_forward", None) is not None for b in selected):
        raise ValueError("a block is already wrapped; unwrap(model) first")
    names = {id(m): name for name, m in model.named_modules()}
    planner = AutoPlanner(stash, selected, [names.get(id(b), type(b).__name__) for b in selected],
                          budget, memory_limit, min_bytes)
    stash.keep(model)
    for j, block in enumerate(selected):
        original = block.forward
        block._actstash_forward = original

        def forward(*args, _j=j, _original=original, **kwargs):
            return planner.forward(_j, _original, args, kwargs)

        block.forward = functools.wraps(original)(forward)
    model._actstash_planner = planner
    stash._planner = planner
    return model


def unwrap(model):
    """Restores the forward of every block wrap() changed."""
    planner = getattr(model, "_actstash_planner", None)
    if planner is not None:
        if planner.stash._planner is planner:
            planner.stash._planner = None
        del model._actstash_planner
    for block in model.modules():
        original = getattr(block, "_actstash_forward", None)
        if original is not None:
            block.forward = original
            del block._actstash_forward
    return model
