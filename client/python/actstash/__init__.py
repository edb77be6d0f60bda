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
    opt = actstash.optim.OffloadAdamW(model.parameters(), lr=1e-3)  # Adam's states in the pool

The native library (libactstash.so, loaded through ctypes) links neither
Python nor torch: one build serves every CPython version and torch >= 1.13.
torch is imported on first use of what needs it (connect, Stash, checkpoint,
wrap, unwrap), so `import actstash` and the `actstash`/`actstashd` commands
work without it.
"""
from typing import TYPE_CHECKING, Any, Dict

from actstash._errors import (BudgetError, StashError, StashFull, StashInvalidArgument,
                              StashNotFound, StashUnavailable)

if TYPE_CHECKING:  # what __getattr__ imports on first use, for type checkers (py.typed)
    from actstash import optim  # noqa: F401
    from actstash._connect import connect  # noqa: F401
    from actstash._hooks import Stash, checkpoint  # noqa: F401
    from actstash._plan import unwrap, use_for_gradient_checkpointing, wrap  # noqa: F401


def client_defaults() -> Dict[str, Any]:
    """Every setting of the native client by its name, with its default: what
    `connect(**client_options)` accepts beyond its own arguments. A new dict each call."""
    from actstash._native import lib
    return dict(lib.CLIENT_DEFAULTS)


# The names of the parts are imported on first use (they import torch): _hooks (the
# saved-tensor hooks and the checkpoint), _connect (the session, a private daemon),
# _plan (wrap and the automatic plan), optim (the optimizers). _native is the C
# library beneath them.
if not TYPE_CHECKING:  # type checkers see the imports above, and no other name
    def __getattr__(name: str) -> Any:
        if name == "optim":  # a submodule (not `from actstash import`: that asks here again)
            import actstash.optim
            return actstash.optim
        if name in ("Stash", "checkpoint"):
            from actstash import _hooks
            value = getattr(_hooks, name)
        elif name == "connect":
            from actstash import _connect
            value = _connect.connect
        elif name in ("unwrap", "use_for_gradient_checkpointing", "wrap"):
            from actstash import _plan
            value = getattr(_plan, name)
        else:
            raise AttributeError(f"module 'actstash' has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__():
    return sorted(set(globals()) | set(__all__) | {"optim"})


__all__ = [
    "BudgetError", "Stash", "StashError", "StashFull", "StashInvalidArgument", "StashNotFound",
    "StashUnavailable",
    "checkpoint", "client_defaults",
    "connect", "unwrap", "use_for_gradient_checkpointing", "wrap",
]
