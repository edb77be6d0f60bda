"""actstash: offload PyTorch activations to the node's actstashd.

    import actstash
    stash = actstash.connect()                  # ACTSTASH_ADDRESS or the default socket
    with stash.offload(min_bytes=64 << 10):     # saved tensors leave the trainer
        loss = model(batch).sum()
    loss.backward()                             # and come back, prefetched
    y = actstash.checkpoint(block, x, stash=stash)   # recompute inside, offload the input
    actstash.wrap(model, stash, blocks=Block, mode="checkpoint+offload")

The native library (libactstash.so, loaded through ctypes) links neither
Python nor torch: one build serves every CPython version and torch >= 1.13.
"""
from actstash._lib import StashError, StashFull, StashNotFound, StashUnavailable
from actstash._stash import Stash, connect
from actstash._checkpoint import checkpoint
from actstash._wrap import unwrap, wrap

__all__ = [
    "Stash", "StashError", "StashFull", "StashNotFound", "StashUnavailable", "checkpoint",
    "connect", "unwrap", "wrap",
]
