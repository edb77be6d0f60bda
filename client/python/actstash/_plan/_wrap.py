"""actstash.wrap: apply offload and/or checkpointing to chosen submodules."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Optional, Union

import torch

from actstash import _hooks
from actstash._hooks import checkpoint, compiling, without_caches
from actstash._native import lib as _lib

_MODES = ("offload", "checkpoint", "checkpoint+offload", "selective")
_POLICIES = ("manual", "auto")
# What mode="selective" saves: the outputs of the ops that cost the most to run
# again per byte they hold (matrix products and convolutions), as the peers' SAC.
_SAVED_BY_SELECTIVE = ("mm", "addmm", "bmm", "baddbmm", "convolution")


def _selective_context():
    """A context_fn for actstash.checkpoint: selective activation checkpointing (torch's
    create_selective_checkpoint_contexts) that saves the outputs of _SAVED_BY_SELECTIVE
    and recomputes every other op. A new policy per call, as torch asks."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    saved = {getattr(aten, name).default for name in _SAVED_BY_SELECTIVE}

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op in saved
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return create_selective_checkpoint_contexts(policy)


def _select(model, blocks):
    if blocks is None:
        blocks = _repeated_blocks(model)
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and
                                    all(isinstance(b, type) for b in blocks)):
        return [m for m in model.modules() if isinstance(m, blocks)]
    if isinstance(blocks, torch.nn.Module):
        return list(blocks.children()) if isinstance(blocks, torch.nn.ModuleList) else [blocks]
    if callable(blocks):
        return [m for m in model.modules() if blocks(m)]
    return list(blocks)


def _repeated_blocks(model):
    """The children of the model's largest outermost ModuleList (most children, then
    most parameters): the repeated blocks of a transformer. Lists inside another
    list's blocks (a mixture-of-experts layer's experts) are not candidates, however
    long."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    inner = {id(sub) for outer in lists for block in outer for sub in block.modules()}
    lists = [m for m in lists if id(m) not in inner]
    if not lists:
        raise ValueError("wrap: the model has no ModuleList to take blocks from; say which "
                         "blocks, e.g. blocks=MyBlock or blocks=model.layers")
    return max(lists, key=lambda m: (len(m), sum(p.numel() for p in m.parameters())))


def wrap(model: torch.nn.Module, stash: Any, blocks: Any = None,
         mode: str = "checkpoint+offload", min_bytes: Optional[int] = None,
         policy: str = "manual", budget: Union[int, float, str, None] = None,
         memory_limit: Union[int, str, None] = None, candidates: int = 3) -> torch.nn.Module:
    """Makes each selected block offload its saved tensors ("offload"), recompute its
    interior ("checkpoint"), recompute its interior and offload its inputs
    ("checkpoint+offload"), or recompute only its cheap ops ("selective": selective
    activation checkpointing that saves the outputs of matrix products and
    convolutions, recomputes the rest and offloads the inputs; what it saves goes to
    the stash too on torch >= 2.14, and stays in the trainer before; needs torch's
    create_selective_checkpoint_contexts, torch >= 2.4). blocks: a module class (or
    tuple), a ModuleList, a predicate on modules, or modules; None takes the children
    of the model's largest ModuleList (a transformer's layers: a Hugging Face model's
    decoder layers). The
    model's parameters and buffers are never offloaded. Returns the model;
    unwrap(model) undoes it.

    policy="auto" chooses per block among keep, offload, checkpoint and
    checkpoint+offload, and on torch >= 2.4 selective and selective+offload (the
    outputs of the block's ops that cost most per byte to recompute are kept in the
    trainer, or offloaded with the block's input, and the other ops are recomputed)
    (`mode` is then unused): the first step of each input shape records each block's
    ops (torch >= 2.4), the next is measured, the plan of least predicted step time
    whose peak memory fits `budget` is applied from the step after, and checked by
    measuring it. budget, by one rule: a number of 1 or more is bytes (6e9 too), a number below
    1 a fraction of the free memory; a string is a size ("6GiB") or a percentage of the
    free memory ("50%"). The free memory: the GPU's (CUDA), else memory_limit (CPU;
    default: the node's available memory). It bounds
    the memory a step adds from the first block's forward to the end of backward
    (saved activations and the transients of forward and backward). stash.plan()
    shows the plan; actstash.BudgetError is raised from forward when no plan fits.
    candidates: before committing, auto measures one step of each of at most this many
    candidate plans (the solved one first) and keeps the fastest whose measured peak
    fits; 1 commits to the solved plan (its check step alone)."""
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {_POLICIES}")
    if min_bytes is None:  # saved tensors below it stay: the engine's default_min_bytes
        min_bytes = _lib.DEFAULT_MIN_BYTES
    if policy == "auto":
        return _wrap_auto(model, stash, blocks, min_bytes, budget, memory_limit, candidates)
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}")
    if stash is None and mode != "checkpoint":
        raise ValueError(f"mode {mode!r} needs a stash")
    if mode == "selective" and not hasattr(torch.utils.checkpoint,
                                           "create_selective_checkpoint_contexts"):
        raise ValueError(f"mode 'selective' needs torch's selective activation checkpointing "
                         f"(torch >= 2.4; this is {torch.__version__})")
    if stash is not None:
        stash.keep(model)
    selected = _select(model, blocks)
    if not selected:
        raise ValueError("wrap: no block matched")
    if mode != "offload":
        _refuse_double_checkpoint(selected, mode)
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
            boundary_stash = stash if mode in ("checkpoint+offload", "selective") else None
            context = _selective_context if mode == "selective" else None

            def forward(*args, _original=original, _stash=boundary_stash, _context=context,
                        **kwargs):
                if not torch.is_grad_enabled():
                    return _original(*args, **kwargs)  # nothing to save, nothing to recompute
                args, kwargs = without_caches(args, kwargs)
                if _stash is not None and compiling():
                    # The hooks' scope in this frame, not in a function it calls:
                    # dynamo runs this frame's scope eagerly and compiles the call
                    # inside it (a scope inside an inlined call breaks the graph).
                    with _stash.offload(min_bytes=min_bytes):
                        return checkpoint(_original, *args, context_fn=_context, **kwargs)
                return checkpoint(_original, *args, stash=_stash, min_bytes=min_bytes,
                                  context_fn=_context, **kwargs)

        block.forward = functools.wraps(original)(forward)
    return model


def _refuse_double_checkpoint(blocks, what):
    """A transformers layer with its own gradient checkpointing on would be
    checkpointed twice (torch's outside, actstash's inside): correct, but every
    forward run three times."""
    for block in blocks:
        if getattr(block, "gradient_checkpointing", False) is True:
            raise ValueError(
                f"wrap({what}): {type(block).__name__} is already checkpointed by transformers' "
                "gradient checkpointing; call model.gradient_checkpointing_disable() (or, in "
                "transformers 5.2x, activation_checkpointing_disable()) first, or "
                "use actstash.use_for_gradient_checkpointing(model, stash) to keep that route "
                "with actstash's checkpoint")


def use_for_gradient_checkpointing(model: Any, stash: Any = None,
                                   min_bytes: Optional[int] = None,
                                   **checkpoint_kwargs: Any) -> Any:
    """Turns on a Hugging Face transformers model's own gradient checkpointing (the
    route Trainer(gradient_checkpointing=True) and accelerate take) with
    actstash.checkpoint in place of torch.utils.checkpoint: with `stash`, each layer's
    inputs are offloaded until its recomputation. checkpoint_kwargs go to
    actstash.checkpoint (e.g. context_fn). Call it instead of
    model.gradient_checkpointing_enable(), and leave Trainer's gradient_checkpointing
    off (it would put torch's checkpoint back). model.gradient_checkpointing_disable()
    (activation_checkpointing_disable() in transformers 5.2x) undoes it. Returns the
    model."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(model).__name__} is not a transformers model with gradient "
                         "checkpointing (no gradient_checkpointing_enable); use "
                         "actstash.wrap(model, stash, mode='checkpoint+offload')")
    if any(getattr(m, "_actstash_forward", None) is not None for m in model.modules()):
        raise ValueError("the model has blocks wrapped by actstash.wrap; unwrap(model) first")
    if "gradient_checkpointing_func" not in inspect.signature(
            model._set_gradient_checkpointing).parameters:
        raise ValueError(f"{type(model).__name__} uses transformers' old gradient checkpointing "
                         "interface (before 4.35); use actstash.wrap(model, stash, "
                         "mode='checkpoint+offload')")
    # transformers' own set-up first (e.g. inputs that require grad for adapters),
    # then its layers get actstash's checkpoint. transformers 5.2x renamed the
    # method activation_checkpointing_enable (the old name warns, and goes in v6).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if stash is not None:
        stash.keep(model)
    if min_bytes is None:  # the engine's default_min_bytes
        min_bytes = _lib.DEFAULT_MIN_BYTES
    function = functools.partial(checkpoint, stash=stash, min_bytes=min_bytes,
                                 **checkpoint_kwargs)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)
    return model


def _wrap_auto(model, stash, blocks, min_bytes, budget, memory_limit, candidates):
    from actstash._plan._auto import AutoPlanner
    if stash is None:
        raise ValueError("policy='auto' needs a stash")
    if getattr(model, "_actstash_planner", None) is not None:
        raise ValueError("the model is already wrapped with policy='auto'; unwrap it first")
    selected = _select(model, blocks)
    if not selected:
        raise ValueError("wrap: no block matched")
    if any(getattr(b, "_actstash_forward", None) is not None for b in selected):
        raise ValueError("a block is already wrapped; unwrap(model) first")
    _refuse_double_checkpoint(selected, "policy='auto'")
    names = {id(m): name for name, m in model.named_modules()}
    planner = AutoPlanner(stash, selected, [names.get(id(b), type(b).__name__) for b in selected],
                          budget, memory_limit, min_bytes, candidates)
    stash.keep(model)
    for j, block in enumerate(selected):
        original = block.forward
        block._actstash_forward = original

        def forward(*args, _j=j, _original=original, **kwargs):
            return planner.forward(_j, _original, args, kwargs)

        block.forward = functools.wraps(original)(forward)
    model._actstash_planner = planner
    _hooks.set_planner(stash, planner)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Restores the forward of every block wrap() changed."""
    planner = getattr(model, "_actstash_planner", None)
    if planner is not None:
        if _hooks.planner_of(planner.stash) is planner:
            _hooks.set_planner(planner.stash, None)
        del model._actstash_planner
    for block in model.modules():
        original = getattr(block, "_actstash_forward", None)
        if original is not None:
            block.forward = original
            del block._actstash_forward
    return model
