"""The hooks: a Stash (a session plus the saved-tensor hooks that use it), the
checkpoint that recomputes inside and offloads its input, and CUDA's side-stream
copies. Every other part of the package uses these names only: what a Stash does
inside (its pack and unpack, its inline threshold, the planner it reports) is
reached through the functions below, never through its private attributes."""
from actstash._hooks._checkpoint import checkpoint, compiling, without_caches
from actstash._hooks._device_copies import CudaCopies
from actstash._hooks._stash import (Stash, aliases_parameter, current_cuda_device, kept_layout,
                                    storage, storage_address, storage_ref)

# aliases_parameter .. storage_ref: what a tensor aliases and how it is laid out, as the
# hooks judge it (a plan's measurement must count storages the way the hooks store them).
__all__ = [
    "CudaCopies", "Stash", "aliases_parameter", "checkpoint", "compiling", "copied_inline",
    "current_cuda_device", "inline_bytes", "kept_layout", "pack", "planner_of", "set_planner",
    "storage", "storage_address", "storage_ref", "unpack", "without_caches",
]


def pack(stash, tensor, min_bytes=None, boundary=False):
    """What `stash`'s pack hook makes of `tensor` (boundary: a checkpoint's input)."""
    return stash._pack(tensor, min_bytes, boundary=boundary)


def unpack(stash, saved, check_version=True):
    """The tensor `saved` (from pack) stands for, back from wherever it went."""
    return stash._unpack(saved, check_version=check_version)


def copied_inline(stash, nbytes, cuda, boundary):
    """Whether a tensor of `nbytes` goes to the daemon by copy (the inline path) rather
    than into a leased block."""
    return stash._copied_inline(nbytes, cuda, boundary)


def inline_bytes(stash):
    """The largest tensor the inline path takes (the client's inline_store_bytes)."""
    return stash._inline_bytes


def set_planner(stash, planner):
    """The planner whose report stash.plan() returns (None: no plan)."""
    stash._planner = planner


def planner_of(stash):
    return stash._planner
