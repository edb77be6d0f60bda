"""wrap(policy="auto"): measure the blocks, solve a plan (_planner), apply it, check it.

The life of one input shape (a step is keyed by the shapes, dtypes and devices of
the first block's tensor inputs):

1. Profile: the first step runs every block as checkpoint+offload (the smallest
   footprint, so profiling itself stays within the budget) and measures per
   block its forward, recomputation and backward times, what it saves for
   backward (seen by the checkpoint as it runs), its inputs, and the memory each
   phase of the step reaches. Then a short probe stores and fetches tensors of
   the largest block's sizes through the stash: the throughput the engine
   reaches on this machine and device.
2. Solve (_planner.solve) and apply the plan from the next step on.
3. Verify: the first step under a new plan is measured the same way. If it
   reached more memory than the budget, the plan is solved again for a budget
   smaller by what the model missed (the measured peak less the predicted one;
   twice at most); otherwise the plan stays.

Memory is what the step holds above what the trainer holds when the first block
starts: on CUDA the caching allocator's allocated bytes (its peak per phase), on
the CPU RssAnon, sampled by a thread every 0.2 ms. RssAnon follows what the
trainer holds only when the allocator gives freed memory back: glibc keeps
freed blocks below its mmap threshold, which rises up to 32 MiB, for reuse;
MALLOC_MMAP_THRESHOLD_=131072 makes it give them back. Sampling misses short
peaks and the peak varies from step to step (by a few percent in the tests'
small models), so on the CPU plans aim at 95% of the budget. Measured steps
synchronize CUDA at phase boundaries; the other steps run with no measurement.

Thread model: block forwards run on the trainer's thread; the backward marks on
autograd's threads, one at a time (a step's backward is sequential). A planner
serves one model trained by one thread.
"""
import logging
import os
import threading
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from actstash import _planner
from actstash._checkpoint import checkpoint
from actstash._planner import BudgetError

log = logging.getLogger("actstash")

_MAX_CORRECTIONS = 2
_PROBE_BYTES = 64 << 20
_CPU_HEADROOM = 0.05  # sampled RssAnon misses short peaks and varies by step


def _storage_key(t):
    return (t.device, t.data_ptr() - t.storage_offset() * t.element_size())


def _is_parameter(t):
    base = t._base
    return (t.requires_grad and t.is_leaf) or (base is not None and base.requires_grad and
                                               base.is_leaf)


class _Bytes:
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
        if not isinstance(t, torch.Tensor) or _is_parameter(t) or t.layout != torch.strided:
            return
        key = _storage_key(t)
        ref = self.live.get(key)
        if ref is None or ref.expired():
            storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
            self.live[key] = StorageWeakRef(storage)
            self.held += storage.nbytes()
        nbytes = t.numel() * t.element_size()
        if nbytes >= self.min_bytes and nbytes > 0 and t.device.type in ("cpu", "cuda"):
            self.stored += nbytes
            self.tensors += 1
            self.largest = max(self.largest, nbytes)
            self.sizes.append(nbytes)


class _Memory:
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
        return (int(data[1]) - int(data[2])) * os.sysconf("SC_PAGE_SIZE")  # RssAnon

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


class _Step:
    """One training step: the choices it runs, and what it measured when measured."""

    def __init__(self, entry, choices, measured, n, min_bytes, device):
        self.entry, self.choices, self.measured = entry, list(choices), measured
        self.n = n
        self.times = {}
        self.recompute = [0.0] * n
        self.saved = [_Bytes(min_bytes) for _ in range(n)]
        self.inputs = [_Bytes(min_bytes) for _ in range(n)]
        self.entered = set()
        self.done = False
        self.memory = _Memory(device) if measured else None
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self, phase):
        if self.memory is not None:
            self.memory.mark(phase) if phase != ("f", 0) else self.memory.start(phase)
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


class _Entry:
    """What the planner knows of one input shape."""

    def __init__(self, key):
        self.key = key
        self.costs = self.machine = self.plan = self.error = None
        self.budget = self.effective_budget = None
        self.stored_limit = float("inf")
        self.corrections = 0
        self.error_bytes = 0  # the most a checked plan's peak exceeded its prediction
        self.incomplete = 0   # measured steps without a complete backward
        self.verify = False
        self.measured = None  # the last measured step: {"time_s", "peak", "blocks": [...]}


class AutoPlanner:
    """Owns the plans of one wrapped model (see the module comment)."""

    def __init__(self, stash, blocks, names, budget, memory_limit, min_bytes):
        self.stash, self.blocks, self.names = stash, blocks, names
        self.budget_spec, self.memory_limit = budget, memory_limit
        self.min_bytes = min_bytes
        self.entries = {}
        self.current = None  # the entry of the latest step
        self.step = None
        _resolve_budget(budget, memory_limit, torch.device("cpu"))  # bad input fails now

    # -- the block forward --------------------------------------------------------------
    def forward(self, j, original, args, kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if j == 0:
            self._begin_step(args, kwargs)
        step = self.step
        if step is None or j >= step.n:
            return original(*args, **kwargs)
        step.mark(("f", j))
        if step.measured:
            for a in list(args) + list(kwargs.values()):
                step.inputs[j].add(a)
        choice = step.choices[j]
        if choice == _planner.KEEP:
            out = original(*args, **kwargs)
        elif choice == _planner.OFFLOAD:
            with self.stash.offload(min_bytes=self.min_bytes):
                out = original(*args, **kwargs)
        else:
            out = checkpoint(self._timed(step, j, original), *args,
                             stash=self.stash if choice == _planner.CHECKPOINT_OFFLOAD else None,
                             min_bytes=self.min_bytes,
                             _observe=step.saved[j].add if step.measured else None, **kwargs)
        if step.measured:
            out = _mark_outputs(step, j, out)
            step.mark(("g", j))  # after the block: glue until the next, or the tail
        return out

    @staticmethod
    def _timed(step, j, original):
        if not step.measured:
            return original
        calls = [0]

        def run(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 1:
                return original(*args, **kwargs)
            if step.cuda:
                torch.cuda.synchronize(step.device)
            start = time.perf_counter()
            out = original(*args, **kwargs)
            if step.cuda:
                torch.cuda.synchronize(step.device)
            step.recompute[j] += time.perf_counter() - start
            return out
        return run

    def _begin_step(self, args, kwargs):
        self._finish_step()
        key = tuple((tuple(a.shape), a.dtype, a.device) for a in list(args) + list(kwargs.values())
                    if isinstance(a, torch.Tensor))
        entry = self.entries.get(key)
        n = len(self.blocks)
        device = next((a.device for a in list(args) + list(kwargs.values())
                       if isinstance(a, torch.Tensor)), torch.device("cpu"))
        if entry is None:
            if device.type != "cuda" and not self.entries and not _glibc_returns_memory():
                log.warning("actstash: on the CPU the plan measures RssAnon, and glibc keeps "
                            "freed blocks for reuse where RssAnon does not see them: run with "
                            "MALLOC_MMAP_THRESHOLD_=131072 for measurements, and so budgets, "
                            "that hold")
            entry = self.entries[key] = _Entry(key)
            entry.budget = _resolve_budget(self.budget_spec, self.memory_limit, device)
            entry.effective_budget = _target(entry.budget, device)
            quota = self.stash.client.quota if self.stash.client is not None else 0
            entry.stored_limit = quota if quota else float("inf")
        if entry.error is not None:
            raise BudgetError(str(entry.error))
        if self.current is not entry and entry.plan is not None:
            self._log_plan(entry, "applied (input shape changed)")
        self.current = entry
        if entry.plan is None:  # profile at the smallest footprint
            smallest = _planner.CHECKPOINT_OFFLOAD if self.stash.available else \
                _planner.CHECKPOINT
            self.step = _Step(entry, [smallest] * n, True, n, self.min_bytes, device)
        else:
            self.step = _Step(entry, entry.plan.choices, entry.verify, n, self.min_bytes, device)

    def _finish_step(self):
        step, self.step = self.step, None
        if step is None or not step.measured:
            return
        if not step.done and len(step.entered) == step.n:
            step.end_backward()  # no end-of-backward callback in this torch: ends now
        if not step.done or len(step.entered) != step.n:
            if step.memory is not None and not step.done:
                step.memory.stop()
            entry = step.entry
            entry.incomplete += 1
            if entry.incomplete == 3:
                log.warning("actstash: 3 measured steps had no complete backward through every "
                            "block (a forward without backward, or blocks whose outputs are "
                            "not tensors that require grad); still measuring")
            return
        peaks = step.peaks
        entry = step.entry
        if entry.plan is None:
            self._solve_profile(entry, step, peaks)
        else:
            self._check(entry, step, peaks)

    # -- measure, solve, check ----------------------------------------------------------
    def _phases(self, step, peaks):
        """Per block: forward and backward durations and phase peaks; tail time and peak."""
        n, times = step.n, step.times
        blocks = []
        for j in range(n):
            forward = times[("g", j)] - times[("f", j)]
            backward_end = times[("b", j - 1)] if j > 0 else times["end"]
            blocks.append({"forward_s": forward, "backward_s": backward_end - times[("b", j)],
                           "forward_peak": peaks.get(("f", j), 0),
                           "backward_peak": peaks.get(("b", j), 0)})
        glue_s = sum(times[("f", j + 1)] - times[("g", j)] for j in range(n - 1))
        tail_s = times[("b", n - 1)] - times[("g", n - 1)] + glue_s
        tail_peak = max([peaks.get(("g", j), 0) for j in range(n)])
        return blocks, tail_s, tail_peak, times["end"] - times[("f", 0)]

    def _solve_profile(self, entry, step, peaks):
        blocks, tail_s, tail_peak, step_s = self._phases(step, peaks)
        costs, held = [], 0
        for j, (b, saved, inputs) in enumerate(zip(blocks, step.saved, step.inputs)):
            cost = _planner.BlockCost(
                name=self.names[j], forward_s=b["forward_s"],
                backward_s=max(0.0, b["backward_s"] - step.recompute[j]),
                recompute_s=step.recompute[j] or b["forward_s"],
                saved_bytes=saved.held, offload_bytes=saved.stored,
                offload_tensors=saved.tensors, largest_tensor=saved.largest,
                input_bytes=inputs.held, input_offload_bytes=inputs.stored,
                input_tensors=inputs.tensors)
            cost.forward_work = max(0, b["forward_peak"] - held)
            cost.backward_work = max(0, b["backward_peak"] - held)
            held += cost.held(step.choices[j])
            costs.append(cost)
        machine = _planner.Machine(tail_s=tail_s, tail_work=max(0, tail_peak - held),
                                   prefetch=self.stash.prefetch_depth,
                                   offload_allowed=self.stash.available,
                                   fetched_in_place=not step.cuda and self.stash.cpu_views)
        if machine.offload_allowed:
            largest = max(step.saved, key=lambda s: s.stored)
            self._probe(machine, largest.sizes, step)
        entry.costs, entry.machine = costs, machine
        entry.measured = {"time_s": step_s, "peak": max(peaks.values(), default=0),
                          "blocks": blocks, "choices": list(step.choices)}
        self._solve(entry, "profiled")

    def _probe(self, machine, sizes, step):
        """Stores and fetches tensors of these sizes through the stash, timed."""
        picked, total = [], 0
        for size in sorted(sizes, reverse=True):
            if total + size > _PROBE_BYTES and picked:
                break
            picked.append(size)
            total += size
        if not picked:
            return
        tensors = [torch.ones(max(1, size // 4), device=step.device) for size in picked]
        stash, best = self.stash, None
        for _ in range(2):
            stash.synchronize()
            start = time.perf_counter()
            saved = [stash._pack(t, 0, boundary=False) for t in tensors]
            packed = time.perf_counter()
            stash.synchronize()
            stored = time.perf_counter()
            out = [stash._unpack(s, check_version=False) for s in saved]
            if step.cuda:
                torch.cuda.synchronize(step.device)
            fetched = time.perf_counter()
            del out, saved
            stash.synchronize()
            run = ((packed - start) / len(picked), total / max(stored - start, 1e-9),
                   total / max(fetched - stored, 1e-9))
            best = run if best is None or run[1] > best[1] else best
        machine.per_tensor_s, machine.store_bps, machine.fetch_bps = best

    def _solve(self, entry, why):
        try:
            plan = _planner.solve(entry.costs, entry.machine, entry.effective_budget,
                                  entry.stored_limit)
        except BudgetError as error:
            if entry.effective_budget != entry.budget:
                error = BudgetError(
                    f"{error} (the budget is {_planner.format_bytes(entry.budget)}; plans aim "
                    f"at {_planner.format_bytes(entry.effective_budget)}: "
                    + ("headroom for sampled memory" if not entry.corrections else
                       "a checked plan used more than predicted") + ")")
            entry.error = error
            log.warning("actstash: %s", error)
            raise error
        changed = entry.plan is None or entry.plan.choices != plan.choices
        entry.plan, entry.verify = plan, True
        if changed:
            self._log_plan(entry, why)

    def _check(self, entry, step, peaks):
        blocks, _, _, step_s = self._phases(step, peaks)
        peak = max(peaks.values(), default=0)
        entry.measured = {"time_s": step_s, "peak": peak, "blocks": blocks,
                          "choices": list(step.choices)}
        entry.verify = False
        target = _target(entry.budget, step.device)
        if peak > target and entry.corrections < _MAX_CORRECTIONS:
            # The model missed this much here: ask the next plan to leave that room.
            entry.corrections += 1
            entry.error_bytes = max(entry.error_bytes, peak - entry.plan.prediction.peak_bytes,
                                    peak - target)
            entry.effective_budget = target - entry.error_bytes
            log.info("actstash: the plan reached %s, over the budget of %s (%s with headroom), "
                     "%s more than predicted: solving for %s", _planner.format_bytes(peak),
                     _planner.format_bytes(entry.budget), _planner.format_bytes(target),
                     _planner.format_bytes(peak - entry.plan.prediction.peak_bytes),
                     _planner.format_bytes(entry.effective_budget))
            try:
                self._solve(entry, "corrected")
            except BudgetError:
                pass  # raised at the next step
        elif peak > entry.budget:
            log.warning("actstash: the plan reached %s, over the budget of %s, after %d "
                        "corrections", _planner.format_bytes(peak),
                        _planner.format_bytes(entry.budget), entry.corrections)

    def _log_plan(self, entry, why):
        p = entry.plan
        log.info("actstash: plan %s for inputs %s: %s; predicted %.1f ms/step, peak %s of "
                 "budget %s", why, _describe_key(entry.key), ", ".join(p.choices),
                 p.prediction.time_s * 1e3, _planner.format_bytes(p.prediction.peak_bytes),
                 _planner.format_bytes(entry.budget))

    # -- what stash.plan() shows ---------------------------------------------------------
    def report(self):
        if self.step is not None and self.step.done:
            try:
                self._finish_step()
            except BudgetError:
                pass  # in the report, and raised at the next step
        entry = self.current
        if entry is None:
            return None
        return PlanReport(entry, self.names)


class PlanReport:
    """The plan of the latest input shape, as stash.plan() returns it: str() is a
    table; the attributes are the numbers."""

    def __init__(self, entry, names):
        self.key = entry.key
        self.budget = entry.budget
        self.error = entry.error
        plan = entry.plan
        self.choices = list(plan.choices) if plan else None
        self.predicted_time_s = plan.prediction.time_s if plan else None
        self.predicted_peak = plan.prediction.peak_bytes if plan else None
        self.predicted_stored = plan.prediction.stored_bytes if plan else None  # in the stash
        self.exact = plan.exact if plan else None
        self.limited_by_quota = plan.limited_by_quota if plan else False
        self.smallest_peak = plan.smallest_peak if plan else None  # predicted, any plan
        self.kept_peak = plan.kept_peak if plan else None  # predicted, every block kept
        measured = entry.measured
        same = measured is not None and plan is not None and measured["choices"] == plan.choices
        self.measured_time_s = measured["time_s"] if same else None
        self.measured_peak = measured["peak"] if same else None
        self.costs, self.machine, self.names = entry.costs, entry.machine, names
        self._plan, self._measured = plan, measured if same else None

    def __str__(self):
        mib = _planner.format_bytes
        if self._plan is None:
            state = f"no plan: {self.error}" if self.error else "profiling (no plan yet)"
            return f"actstash plan for inputs {_describe_key(self.key)}: {state}"
        p, m = self._plan.prediction, self._measured
        lines = [
            f"actstash plan for inputs {_describe_key(self.key)}: budget {mib(self.budget)}",
            f"  peak predicted {mib(p.peak_bytes)}, measured "
            f"{mib(m['peak']) if m else '-'}; step predicted {p.time_s * 1e3:.1f} ms, measured "
            f"{'%.1f ms' % (m['time_s'] * 1e3) if m else '-'}; "
            f"{'optimal under the model' if self._plan.exact else 'best found (not proven)'}"
            f"{'; limited by the quota' if self._plan.limited_by_quota else ''}",
            f"  peaks reachable: {mib(self.smallest_peak)} (smallest) to {mib(self.kept_peak)} "
            f"(every block kept)",
            f"  stash: store {self.machine.store_bps / 1e9:.2f} GB/s, fetch "
            f"{self.machine.fetch_bps / 1e9:.2f} GB/s, {self.machine.per_tensor_s * 1e6:.0f} "
            f"us/tensor" if self.machine.offload_allowed else "  stash: unavailable",
            f"  {'block':<20} {'saves':>10} {'choice':<19} {'fwd ms':>13} {'bwd ms':>13} "
            f"{'held':>10} {'peak':>21}",
        ]
        for j, (c, choice) in enumerate(zip(self.costs, self._plan.choices)):
            mb = m["blocks"][j] if m else None
            fwd = f"{p.forward_s[j] * 1e3:.1f}/" + (f"{mb['forward_s'] * 1e3:.1f}" if mb else "-")
            bwd = f"{p.backward_s[j] * 1e3:.1f}/" + (f"{mb['backward_s'] * 1e3:.1f}" if mb
                                                    else "-")
            peak = f"{mib(p.phase_peak[j])}/" + (
                mib(max(mb["forward_peak"], mb["backward_peak"])) if mb else "-")
            lines.append(f"  {c.name[:20]:<20} {mib(c.saved_bytes):>10} {choice:<19} {fwd:>13} "
                         f"{bwd:>13} {mib(p.held[j]):>10} {peak:>21}")
        lines.append("  (fwd, bwd, peak: predicted/measured; held: kept until backward)")
        return "\n".join(lines)

    __repr__ = __str__


def _mark_outputs(step, j, out):
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


def _target(budget, device):
    """What plans aim at: the budget, less headroom on the CPU (sampled memory)."""
    return budget if device.type == "cuda" else int(budget * (1 - _CPU_HEADROOM))


def _describe_key(key):
    return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')} {device}"
                     for shape, dtype, device in key) or "none"


def _resolve_budget(budget, memory_limit, device):
    """Bytes from an int, a size string, or a fraction of the device's free memory
    (CUDA) or of memory_limit (CPU; default: MemAvailable)."""
    if isinstance(budget, bool) or budget is None:
        raise ValueError("policy='auto' needs budget=: bytes, a size like '6GiB', or a fraction")
    if isinstance(budget, str):
        return _planner.parse_bytes(budget)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive, not {budget}")
        return budget
    if isinstance(budget, float) and 0 < budget <= 1:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(budget * free)
        if memory_limit is not None:
            limit = (_planner.parse_bytes(memory_limit) if isinstance(memory_limit, str)
                     else int(memory_limit))
        else:
            limit = _mem_available()
        return int(budget * limit)
    raise ValueError(f"budget must be bytes, a size string or a fraction in (0, 1], "
                     f"not {budget!r}")


def _glibc_returns_memory():
    """Whether glibc's mmap threshold is fixed (freed large blocks go back at once)."""
    return ("MALLOC_MMAP_THRESHOLD_" in os.environ or
            "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""))


def _mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("no MemAvailable in /proc/meminfo: give memory_limit=")
