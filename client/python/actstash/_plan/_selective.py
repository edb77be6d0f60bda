"""Per-operation selective checkpointing, for the automatic plan: inside a
checkpointed block each op's output is kept in the trainer, offloaded to the
stash, or recomputed in backward, named by the op's position in the block's
sequence of ops.

torch's create_selective_checkpoint_contexts (torch >= 2.4) answers save or
recompute per op and keeps what it saves in the trainer (what it caches reaches
saved-tensor hooks only from torch 2.14). These two dispatch modes are the same
mechanism with a third answer, offload, on every torch that has
create_selective_checkpoint_contexts; a plan names positions, so it can treat
two calls of one op differently.

Contract, as torch's SAC: the recomputation must run the same ops in the same
order as the forward (checked: a different op at a position raises), and an op
output saved here should not be changed in place after it was saved. A kept one
changed since (its version, as torch checks) is made again from the recomputed
inputs at retrieval; an offloaded one is not checked (the dispatch-level tensor
the stash would read the version through does not outlive the op): a change
before its asynchronous copy is done would go unseen. The profile (OpRecorder)
finds the outputs changed in place (by a later op that writes their storage, or
seen changed at its end), and the rule (choose_saved) never saves those, views,
in-place ops, nor ops that draw from the RNG (dropout: the recomputation replays
the forward's RNG state, as torch's checkpoint does, and a skipped draw would
shift every later one); the forward saves nothing at a position whose op became
one of those (a block that took another path), and the recomputation checks the
op and its inputs' shapes at each saved position.

Thread model: the forward mode runs on the trainer's thread, the recompute mode
on autograd's thread during backward; a context pair serves one checkpoint call.
"""
import contextlib
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from actstash import _hooks

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"


def supported():
    """Whether this torch has what per-op plans need (the SAC generation, >= 2.4)."""
    return hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts")


def _ignored_ops():
    # torch's list: ops whose count differs between forward and recomputation.
    ignored = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", None)
    return frozenset(ignored) if ignored is not None else frozenset(
        {torch.ops.aten.detach.default})


_IGNORED = None


def _counted(func):
    global _IGNORED
    if _IGNORED is None:
        _IGNORED = _ignored_ops()
    return func not in _IGNORED and isinstance(func, torch._ops.OpOverload)


def _detach(x):
    """A detached alias that shares x's version counter (so later in-place changes are
    seen), made below autograd as torch's SAC makes it; and that does not hold x's graph."""
    if not isinstance(x, torch.Tensor):
        return x
    guard = getattr(torch._C, "_SetExcludeDispatchKeyGuard", None)
    if guard is None:
        return x.detach()
    with guard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def _is_view_or_inplace(func):
    """Outputs that alias an input: a view (nothing of its own to save; saving it would
    hold its base) or an in-place op (its output is its input, changed)."""
    schema = func._schema
    return any(r.alias_info is not None for r in schema.returns) or any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_random(func):
    """An op that draws from the RNG (dropout): always recomputed. The recomputation
    replays the forward's RNG state; skipping one draw would shift every later one."""
    seeded = getattr(torch.Tag, "nondeterministic_seeded", None)
    return seeded is not None and seeded in getattr(func, "tags", ())


def _shapes(args):
    """The shapes and dtypes of an op's tensor arguments (what the recomputation must
    give the op at the same position)."""
    found = []

    def add(x):
        if isinstance(x, torch.Tensor):
            found.append((tuple(x.shape), x.dtype))
        return x
    tree_map(add, list(args))
    return found


def _storage_of(x):
    try:
        return x.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return None


def _tensor_bytes(out):
    total = 0

    def add(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        return x
    tree_map(add, out)
    return total


class _Forward(TorchDispatchMode):
    def __init__(self, choices, stash, min_bytes, storage):
        super().__init__()
        self.choices, self.stash, self.min_bytes = choices, stash, min_bytes
        self.storage = storage
        self.index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _counted(func):
            return out
        i, self.index = self.index, self.index + 1
        choice = self.choices.get(i, RECOMPUTE)
        if choice != RECOMPUTE and (_is_view_or_inplace(func) or _is_random(func)):
            choice = RECOMPUTE  # another op than the profile's at i (the code took a new path)
        if choice == KEEP:
            self.storage[i] = (func, _shapes(args), tree_map(_Kept, out))
        elif choice == OFFLOAD:
            self.storage[i] = (func, _shapes(args), tree_map(self._offload, out))
        return out

    def _offload(self, x):
        if not isinstance(x, torch.Tensor):
            return _Kept(x)
        # Stored asynchronously (the engine holds x until copied); see the module comment.
        packed = _hooks.pack(self.stash, x, self.min_bytes, boundary=False)
        return _Kept(x) if packed is x else _Stored(packed)


class _Kept:
    def __init__(self, x):
        self.value = _detach(x)
        self.version = x._version if isinstance(x, torch.Tensor) else None

    def changed(self):
        return self.version is not None and self.value._version != self.version

    def get(self, stash):
        return self.value


class _Stored:
    def __init__(self, packed):
        self.packed = packed

    def get(self, stash):
        return _hooks.unpack(stash, self.packed, check_version=True)


class _Recompute(TorchDispatchMode):
    def __init__(self, stash, storage):
        super().__init__()
        self.stash, self.storage = stash, storage
        self.index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _counted(func):
            return func(*args, **kwargs)
        i, self.index = self.index, self.index + 1
        entry = self.storage.pop(i, None)
        if entry is None:
            return func(*args, **kwargs)
        saved_func, shapes, value = entry
        if saved_func is not func or shapes != _shapes(args):
            raise RuntimeError(f"actstash: the recomputation ran {func} on {_shapes(args)} where "
                               f"the forward ran {saved_func} on {shapes} (op {i} of the block): "
                               "a block the plan recomputes must run the same ops in the same "
                               "order")
        leaves = _leaves(value)
        if any(isinstance(leaf, _Kept) and leaf.changed() for leaf in leaves):
            # Changed in place after the forward kept it (the profile did not see it):
            # made again from the recomputed inputs, which is what it was.
            return func(*args, **kwargs)
        return tree_map(lambda leaf: leaf.get(self.stash), value)


def context_fn(choices, stash, min_bytes):
    """A context_fn for actstash.checkpoint: op i's output is kept, offloaded or
    recomputed as choices.get(i, RECOMPUTE) says. A new storage per call."""
    def make():
        storage = {}
        return (_Forward(choices, stash, min_bytes, storage), _Recompute(stash, storage))
    return make


class OpRecorder:
    """The profile of one block's ops, recorded during its recomputation: per counted
    op its name, output bytes, time, and whether its output may be saved (not a view,
    not in place, not random, a floating-point tensor output, not changed in place
    afterwards).
    Times are wall time around each op (the device synchronized on CUDA): used as
    shares of the block's measured recomputation, not as absolute figures."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.ops = None  # [[name, bytes, seconds, savable]], once recorded

    def context_fn(self):
        def make():
            return contextlib.nullcontext(), _Record(self)
        return make


class _Record(TorchDispatchMode):
    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder
        self.ops, self.outputs, self.storages = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _counted(func):
            return func(*args, **kwargs)
        cuda = self.recorder.cuda
        written = _written_storages(func, args, kwargs)
        if written:
            # Changed in place now: what an earlier op made there may not be saved
            # (its tensor may be gone by the time the block ends: seen here).
            for op, storages in zip(self.ops, self.storages):
                if storages & written:
                    op[3] = False
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        leaves = [x for x in _leaves(out) if isinstance(x, torch.Tensor)]
        savable = bool(leaves) and not _is_view_or_inplace(func) and not _is_random(func) \
            and all(x.is_floating_point() for x in leaves)
        self.ops.append([str(func.overloadpacket.__name__), _tensor_bytes(out), seconds, savable])
        self.outputs.append([(weakref.ref(x), x._version) for x in leaves])
        self.storages.append({_storage_of(x) for x in leaves} - {None})
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        # Changed in place after it was made (seen while it lives): never saved.
        for op, outputs in zip(self.ops, self.outputs):
            for ref, version in outputs:
                x = ref()
                if x is not None and x._version != version:
                    op[3] = False
        self.recorder.ops = self.ops
        self.outputs = []
        return result


def _written_storages(func, args, kwargs):
    """The storages of the arguments `func` writes (in-place and out= ops)."""
    written = set()
    schema = func._schema
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or position >= len(args) \
            else args[position]
        for x in _leaves(value):
            if isinstance(x, torch.Tensor):
                written.add(_storage_of(x))
    return written - {None}


def _leaves(out):
    found = []
    tree_map(found.append, out)
    return found


def choose_saved(ops):
    """The positions a selective plan saves: the savable ops whose recomputation costs
    more per byte of output than the block's average; every other op is recomputed (the
    cheapest bytes to make again). Returns (positions, saved bytes, the share of the
    block's op time the saved ops take: what recomputation no longer runs)."""
    total_s = sum(op[2] for op in ops)
    total_b = sum(op[1] for op in ops if op[3])
    if not ops or total_s <= 0 or total_b <= 0:
        return [], 0, 0.0
    average = sum(op[2] for op in ops if op[3]) / total_b
    positions = [i for i, op in enumerate(ops) if op[3] and op[1] > 0 and
                 op[2] / op[1] > average]
    saved_bytes = sum(ops[i][1] for i in positions)
    share = sum(ops[i][2] for i in positions) / total_s
    return positions, saved_bytes, share
