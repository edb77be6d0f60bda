"""actstash: offload PyTorch activations to the node's actstashd.

    import actstash
    stash = actstash.connect()                  # ACTSTASH_ADDRESS or the default socket
    with stash.offload(min_bytes=64 << 10):     # saved tensors leave the trainer
        loss = model(batch).sum()
    loss.backward()                             # and come back, prefetched
    y = actstash.checkpoint(block, x, stash=stash)   # recompute inside, offload the input
    actstash.wrap(model, stash, blocks=Block, mode="checkpoint+offload")
    actstash.wrap(model, stash, policy="auto", budget="6GiB")   # a plan per block
    actstash.use_for_gradient_checkpointing(hf_model, stash)  # transformers' own route
    print(stash.plan())
    opt = actstash.optim.OffloadAdamW(model.parameters(), stash)  # Adam's states in the pool

The native library (libactstash.so, loaded through ctypes) links neither
Python nor torch: one build serves every CPython version and torch >= 1.13.
torch is imported on first use of what needs it (connect, Stash, checkpoint,
wrap, unwrap), so `import actstash` and the `actstash`/`actstashd` commands
work without it.
"""
import importlib

from actstash._errors import (BudgetError, StashError, StashFull, StashNotFound,
                              StashUnavailable)

_LAZY = {"Stash": "_stash", "connect": "_stash",
         "checkpoint": "_checkpoint", "unwrap": "_wrap", "use_for_gradient_checkpointing": "_wrap",
         "wrap": "_wrap"}


def client_defaults():
    """Every setting of the native client by its name, with its default: what
    `connect(**client_options)` accepts beyond its own arguments. A new dict each call."""
    from actstash import _lib
    return dict(_lib.CLIENT_DEFAULTS)


def __getattr__(name):
    if name == "optim":  # a submodule, imported on first use (it imports torch)
        return importlib.import_module("actstash.optim")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'actstash' has no attribute {name!r}")
    value = getattr(importlib.import_module("actstash." + module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + ["optim"])


__all__ = [
    "BudgetError", "Stash", "StashError", "StashFull", "StashNotFound", "StashUnavailable",
    "checkpoint", "client_defaults",
    "connect", "unwrap", "use_for_gradient_checkpointing", "wrap",
]
