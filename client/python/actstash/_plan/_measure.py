"""One measured training step of the automatic plan (_auto.py): per-phase times
and memory peaks, what each block saves for backward and its inputs.

Phases: ("f", j) a block's forward, ("g", j) after it until the next block (or,
after the last, the tail until backward reaches it), ("b", j) backward from
block j's outputs to the next block's, "end" after backward. Memory is relative
to the start of the first block's forward: on CUDA the caching allocator's
allocated bytes (its own peak, reset at each boundary), on the CPU RssAnon
sampled by a thread every 0.2 ms.

Thread model: forward marks on the trainer's thread; backward marks on
autograd's threads, one at a time; the sampling thread only writes the peak of
the current phase.
"""
import os
import threading
import time

import torch

from actstash._hooks import (aliases_parameter, kept_layout, storage, storage_address,
                             storage_ref)

_PAGE = os.sysconf("SC_PAGE_SIZE")


class SavedBytes:
    """What a set of tensors holds (distinct storages) and what offloading stores.

    Storages are told apart by address while they live: in a checkpointed forward
    the saved tensors die at once and the allocator hands their addresses to the
    next ones, which keeping would have held as well."""

    def __init__(self, min_bytes):
        self.min_bytes = min_bytes
        self.live = {}  # address -> weak reference of the storage counted there
        self.held = self.stored = self.tensors = self.largest = 0
        self.sizes = []

    def add(self, t):
        if not isinstance(t, torch.Tensor) or aliases_parameter(t) or t.layout != torch.strided:
            return
        key = (t.device, storage_address(t))
        ref = self.live.get(key)
        if ref is None or ref.expired():
            self.live[key] = storage_ref(t)
            self.held += storage(t).nbytes()
        nbytes = t.numel() * t.element_size()
        if (nbytes >= self.min_bytes and nbytes > 0 and t.device.type in ("cpu", "cuda")
                and not kept_layout(t)):
            self.stored += nbytes
            self.tensors += 1
            self.largest = max(self.largest, nbytes)
            self.sizes.append(nbytes)


class PhaseMemory:
    """Per-phase peaks of the step's memory, relative to its start."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.peaks = {}
        self.phase = None
        self._running = False
        self._thread = None
        self._fd = None

    def _now(self):
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        data = os.pread(self._fd, 256, 0).split()
        return (int(data[1]) - int(data[2])) * _PAGE  # RssAnon

    def start(self, phase):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self.baseline = self._now()
        self.phase = phase
        self.peaks = {phase: 0}
        if not self.cuda:
            self._running = True
            self._thread = threading.Thread(target=self._sample, name="actstash-plan-memory",
                                            daemon=True)
            self._thread.start()

    def _sample(self):
        while self._running:
            value = self._now() - self.baseline
            phase = self.phase
            if value > self.peaks.get(phase, 0):
                self.peaks[phase] = value
            time.sleep(0.0002)

    def mark(self, phase):
        """The phase before ends and `phase` begins, now."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self.baseline
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            peak = self._now() - self.baseline
        old = self.phase
        self.peaks[old] = max(self.peaks.get(old, 0), peak)
        now = (self._now() - self.baseline) if self.cuda else peak
        self.phase = phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), now)

    def stop(self):
        self.mark(None)
        self._running = False
        if self._thread is not None:
            self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.peaks.pop(None, None)
        return self.peaks


class _Enter(torch.autograd.Function):
    """Identity whose backward says that backward reached block j's output."""

    @staticmethod
    def forward(ctx, step, j, x):
        ctx.step, ctx.j = step, j
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.step.enter_backward(ctx.j)
        return None, None, grad


class Step:
    """One training step: the choices it runs, and what it measured when measured."""

    def __init__(self, entry, choices, measured, n, min_bytes, device):
        self.entry, self.choices, self.measured = entry, list(choices), measured
        self.n = n
        self.times = {}
        self.recompute = [0.0] * n
        # What blocks save and take, counted in measured steps only.
        self.saved = [SavedBytes(min_bytes) for _ in range(n)] if measured else None
        self.inputs = [SavedBytes(min_bytes) for _ in range(n)] if measured else None
        self.entered = set()
        self.done = False
        self.memory = PhaseMemory(device) if measured else None
        self.device = device
        self.cuda = device.type == "cuda"
        # The op profile's step (_selective.OpRecorder per block), else None.
        self.recorders = None

    def mark(self, phase):
        if self.memory is not None:
            if phase == ("f", 0):
                self.memory.start(phase)  # the step begins
            else:
                self.memory.mark(phase)
        self.times[phase] = time.perf_counter()

    def enter_backward(self, j):
        if j in self.entered:
            return
        self.entered.add(j)
        if not self.entered - {j}:  # the first block backward reaches: ends with backward
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
            except (AttributeError, RuntimeError):
                pass
        self.mark(("b", j))

    def end_backward(self):
        if not self.done:
            self.mark("end")
            self.done = True
            if self.memory is not None:
                self.peaks = self.memory.stop()
                self.peaks.pop("end", None)  # after backward: the optimizer's, not ours


def mark_outputs(step, j, out):
    def mark(t):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return _Enter.apply(step, j, t)
        return t
    if isinstance(out, torch.Tensor):
        return mark(out)
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(mark(t) for t in out)
    if isinstance(out, list):
        return [mark(t) for t in out]
    if isinstance(out, dict):
        for k in list(out):
            out[k] = mark(out[k])
        return out
    return out  # a structure the marks do not reach: its backward is timed with the next
