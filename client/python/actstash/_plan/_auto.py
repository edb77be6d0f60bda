"""wrap(policy="auto"): measure the blocks, solve a plan (_planner), apply it, check it.

The life of one input shape (a step is keyed by the shapes, dtypes and devices of
the first block's tensor inputs):

0. Ops (torch >= 2.4, not under compile): the first step runs every block as
   checkpoint+offload, unmeasured, and records each block's ops as its
   recomputation runs them (_selective.OpRecorder: output bytes, time, whether
   the output may be saved). The selective choices save the ops that cost most
   per byte to recompute (_selective.choose_saved) and recompute the rest.
1. Profile: the next step runs every block as checkpoint+offload (the smallest
   footprint, so profiling itself stays within the budget) and measures per
   block its forward, recomputation and backward times, what it saves for
   backward (seen by the checkpoint as it runs), its inputs, and the memory each
   phase of the step reaches. Then a short probe stores and fetches tensors of
   the largest block's sizes through the stash: the throughput the engine
   reaches on this machine and device. The daemon is asked for this session's share
   of the node's copy bandwidth (its node figure over the sessions copying at once);
   while other sessions copy too, the plan counts on the smaller of probe and share.
2. Solve (_planner.solve), then measure before committing: the solved plan and
   up to two more candidates (_planner.candidates: the plan solved without the
   model's safety factor on copies, the fastest uniform plan predicted to fit) run
   one measured step each, and the fastest whose measured peak fits the budget is
   kept (the solved plan unless another is more than 3% faster). A model that
   predicted wrong, in time or memory, on this machine costs a few steps, not the
   run. When no candidate fits as measured, the solved plan's step goes to 3.
   wrap(candidates=1) commits to the solved plan without trials.
3. Verify: the first step under a new plan is measured the same way. If it
   reached more memory than the budget, the plan is solved again for a budget
   smaller by what the model missed (the measured peak less the predicted one;
   twice at most), but never below the smallest reachable peak: the plan of
   that peak is tried (and measured) before anything is refused, and when it is
   the plan that missed, it stays, with a warning; otherwise the plan stays.
4. Follow the node: while a checked plan runs, the share is asked for about once a
   second; when the rates it gives move by more than 25% (ranks started or stopped
   copying), the plan is solved again with them and checked as in 3.

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
import dataclasses
import logging
import os
import time

import torch

from actstash import _hooks
from actstash._errors import BudgetError
from actstash._hooks import checkpoint, compiling, without_caches
from actstash._plan import _planner, _selective
from actstash._plan._measure import Step, mark_outputs

log = logging.getLogger("actstash")

_MAX_CORRECTIONS = 2
# While a plan runs, the copy share is asked for this often, and a plan follows it when
# the rates it gives move by more than this fraction.
_SHARE_POLL_S = 1.0
_SHARE_CHANGE = 0.25
# Profiles of one shape before a budget no plan meets is refused: one step's sampled
# memory can catch a transient (an allocator growing its heap, a thread pool starting)
# that the next step does not repeat.
_MAX_PROFILES = 2
_PROBE_BYTES = 64 << 20
_PROBE_RUNS = 3
_CPU_HEADROOM = 0.05  # sampled RssAnon misses short peaks and varies by step
# Another candidate replaces the solved plan only when measured this much faster: one
# step's time varies by a few percent, and the solved plan is the model's answer.
_TRIAL_MARGIN = 0.03


class _Entry:
    """What the planner knows of one input shape."""

    def __init__(self, key):
        self.key = key
        self.costs = self.machine = self.plan = self.error = None
        self.budget = self.effective_budget = None
        self.stored_limit = float("inf")
        self.corrections = 0
        self.profiles = 0     # profiling steps measured
        self.profiled = None  # (costs, machine) of the previous profile, if one was refused
        self.error_bytes = 0  # the most a checked plan's peak exceeded its prediction
        self.incomplete = 0   # measured steps without a complete backward
        self.verify = False
        self.measured = None  # the last measured step: {"time_s", "peak", "blocks": [...]}
        self.share_refused = None  # (store, fetch) rates a re-plan found no plan for
        self.trials = None    # [_Trial], the candidates measured after profiling
        self.trial_index = 0  # the next to measure; == len(trials) once chosen
        self.chosen = None    # the _Trial kept
        # The op profile: per block OpRecorder.ops; None before it ran, False when per-op
        # plans are not used (torch < 2.4, under compile, or no complete profile).
        self.ops = None
        self.op_tries = 0
        self.selective = None  # per block: the op positions the selective choices save

    def pending_trial(self):
        """The candidate whose measured step is next, or None (no candidates, or chosen)."""
        if self.trials is None or self.trial_index == len(self.trials):
            return None
        return self.trials[self.trial_index]


class _Trial:
    """A candidate plan and its one measured step."""

    def __init__(self, choices, prediction, at_probed_rate):
        self.choices, self.prediction = list(choices), prediction
        # The prediction with copies counted at the probed rate for memory too (no
        # safety factor): what made it a candidate (its peak fits the budget).
        self.at_probed_rate = at_probed_rate
        self.measured = None  # {"time_s", "peak", "blocks", "choices"}, as _Entry.measured
        self.check = None     # (step, peaks) of that step, for _check


class AutoPlanner:
    """Owns the plans of one wrapped model (see the module comment)."""

    def __init__(self, stash, blocks, names, budget, memory_limit, min_bytes, candidates=3):
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
            raise ValueError(f"candidates must be an int >= 1, not {candidates!r}")
        self.stash, self.blocks, self.names = stash, blocks, names
        self.max_candidates = candidates
        self.budget_spec, self.memory_limit = budget, memory_limit
        self.min_bytes = min_bytes
        self.entries = {}
        self.current = None  # the entry of the latest step
        self.step = None
        self.share_asked = float("-inf")  # time.monotonic() of the last copy share asked
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
        if step.measured:  # unmeasured steps only run the plan
            step.mark(("f", j))
            for a in list(args) + list(kwargs.values()):
                step.inputs[j].add(a)
        choice = step.choices[j]
        if choice == _planner.KEEP:
            out = original(*args, **kwargs)
        elif choice == _planner.OFFLOAD:
            with self.stash.offload(min_bytes=self.min_bytes):
                out = original(*args, **kwargs)
        else:
            args, kwargs = without_caches(args, kwargs)
            offload = choice in (_planner.CHECKPOINT_OFFLOAD, _planner.SELECTIVE_OFFLOAD)
            context_fn = None
            if step.recorders is not None:
                context_fn = step.recorders[j].context_fn()
            elif choice in (_planner.SELECTIVE, _planner.SELECTIVE_OFFLOAD):
                how = _selective.OFFLOAD if offload else _selective.KEEP
                context_fn = _selective.context_fn(
                    {i: how for i in step.entry.selective[j]}, self.stash, self.min_bytes)
            out = checkpoint(self._timed(step, j, original), *args,
                             stash=self.stash if offload else None, min_bytes=self.min_bytes,
                             context_fn=context_fn,
                             _observe=step.saved[j].add if step.measured else None, **kwargs)
        if step.measured:
            out = mark_outputs(step, j, out)
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
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        key = tuple((tuple(a.shape), a.dtype, a.device) for a in tensors)
        entry = self.entries.get(key)
        n = len(self.blocks)
        device = tensors[0].device if tensors else torch.device("cpu")
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
        if entry.plan is not None and not entry.verify:
            self._follow_share(entry)
        if entry.plan is None:  # profile at the smallest footprint
            smallest = _planner.CHECKPOINT_OFFLOAD if self.stash.available else \
                _planner.CHECKPOINT
            if entry.ops is None and (not _selective.supported() or compiling()):
                entry.ops = False
            ops_step = entry.ops is None
            self.step = Step(entry, [smallest] * n, not ops_step, n, self.min_bytes, device)
            if ops_step:  # first the ops of each block, in an unmeasured step
                self.step.recorders = [_selective.OpRecorder(device.type == "cuda")
                                       for _ in range(n)]
        elif entry.pending_trial() is not None:
            self.step = Step(entry, entry.pending_trial().choices, True, n, self.min_bytes,
                             device)
        else:
            self.step = Step(entry, entry.plan.choices, entry.verify, n, self.min_bytes, device)

    def _finish_step(self):
        step, self.step = self.step, None
        if step is not None and step.recorders is not None:
            self._ops_done(step)
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
        elif entry.pending_trial() is not None:
            self._trial_done(entry, step, peaks)
        else:
            self._check(entry, step, peaks)

    # -- measure, solve, check ----------------------------------------------------------
    def _ops_done(self, step):
        """The op profile's step ended: its ops per block, once every block recomputed
        (a step without backward is profiled again, twice at most)."""
        entry = step.entry
        ops = [r.ops for r in step.recorders]
        if all(o is not None for o in ops):
            entry.ops = ops
            return
        entry.op_tries += 1
        if entry.op_tries >= 3:
            log.info("actstash: no complete op profile in 3 steps; planning per block")
            entry.ops = False

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

        def inline(sizes, boundary):
            return sum(n for n in sizes if _hooks.copied_inline(self.stash, n, step.cuda, boundary))

        for j, (b, saved, inputs) in enumerate(zip(blocks, step.saved, step.inputs)):
            cost = _planner.BlockCost(
                name=self.names[j], forward_s=b["forward_s"],
                backward_s=max(0.0, b["backward_s"] - step.recompute[j]),
                recompute_s=step.recompute[j] or b["forward_s"],
                saved_bytes=saved.held, offload_bytes=saved.stored,
                offload_tensors=saved.tensors, largest_tensor=saved.largest,
                input_bytes=inputs.held, input_offload_bytes=inputs.stored,
                input_tensors=inputs.tensors,
                offload_inline_bytes=inline(saved.sizes, False),
                input_inline_bytes=inline(inputs.sizes, True))
            cost.forward_work = max(0, b["forward_peak"] - held)
            cost.backward_work = max(0, b["backward_peak"] - held)
            held += cost.held(step.choices[j])
            costs.append(cost)
        if entry.ops:
            self._add_selective(entry, costs, step)
        machine = _planner.Machine(tail_s=tail_s, tail_work=max(0, tail_peak - held),
                                   prefetch=self.stash.prefetch_depth,
                                   offload_allowed=self.stash.available,
                                   fetched_in_place=not step.cuda and self.stash.cpu_views,
                                   max_in_flight_bytes=self.stash.max_in_flight_bytes,
                                   selective_allowed=bool(entry.ops))
        if machine.offload_allowed:
            largest = max(step.saved, key=lambda s: s.stored)
            self._probe(machine, largest.sizes, step)
        entry.profiles += 1
        if entry.profiled is not None:
            _keep_smaller_working_sets(costs, machine, *entry.profiled)
        entry.costs, entry.machine = costs, machine
        entry.measured = _measurement(step, peaks, blocks, step_s)
        final = entry.profiles >= _MAX_PROFILES
        try:
            self._solve(entry, "profiled", final=final)
        except BudgetError as error:
            if final:
                raise
            # Profile once more (the plan stays None) before refusing the budget.
            entry.profiled = (costs, machine)
            log.info("actstash: %s; profiling once more before refusing it", error)
            return
        self._plan_trials(entry)

    def _add_selective(self, entry, costs, step):
        """The selective choices' costs, from the op profile: which ops they save
        (_selective.choose_saved), what those hold and store, and what recomputing the
        rest takes (the block's measured recomputation times the others' share)."""
        entry.selective = []
        for cost, ops in zip(costs, entry.ops):
            positions, nbytes, share = _selective.choose_saved(ops)
            stored = [ops[i][1] for i in positions if ops[i][1] >= self.min_bytes]
            entry.selective.append(positions)
            cost.selective_bytes = nbytes
            cost.selective_offload_bytes = sum(stored)
            cost.selective_tensors = len(stored)
            cost.selective_inline_bytes = sum(
                n for n in stored if _hooks.copied_inline(self.stash, n, step.cuda, False))
            cost.selective_recompute_s = cost.recompute_s * (1.0 - share)

    # -- measure the candidates, keep the fastest that fits ------------------------------
    def _plan_trials(self, entry):
        choices = _planner.candidates(entry.costs, entry.machine, entry.plan,
                                      entry.stored_limit, self.max_candidates)
        if len(choices) < 2:
            return  # the solved plan alone: checked as in 3
        probed = _planner.without_safety_factor(entry.machine)
        entry.trials = [_Trial(c, _planner.simulate(entry.costs, entry.machine, c),
                               _planner.simulate(entry.costs, probed, c)) for c in choices]
        entry.trial_index = 0
        log.info("actstash: measuring %d candidate plans for inputs %s, one step each: %s",
                 len(choices), _describe_key(entry.key),
                 "; ".join(", ".join(c) for c in choices))

    def _trial_done(self, entry, step, peaks):
        trial = entry.pending_trial()
        blocks, _, _, step_s = self._phases(step, peaks)
        trial.measured = _measurement(step, peaks, blocks, step_s)
        trial.check = (step, peaks)
        entry.trial_index += 1
        if entry.trial_index == len(entry.trials):
            self._choose(entry, _target(entry.budget, step.device))

    def _choose(self, entry, target):
        first = entry.trials[0]  # the solved plan, entry.plan
        fitting = [t for t in entry.trials if t.measured["peak"] <= target]
        if not fitting:
            # None fits as measured: the solved plan's step is checked (corrections).
            log.info("actstash: no candidate plan fit the budget as measured; checking the "
                     "solved one")
            self._check(entry, *first.check)
            return
        best = min(fitting, key=lambda t: t.measured["time_s"])
        if best is not first and first in fitting and \
                best.measured["time_s"] > first.measured["time_s"] * (1 - _TRIAL_MARGIN):
            best = first
        entry.chosen = best
        if best is not first:
            solved = entry.plan
            # What the solved plan says of the quota holds for every candidate: each
            # is within it, and the plan the quota ruled out was predicted faster
            # than the solved one, the fastest predicted within it.
            entry.plan = _planner.Plan(choices=list(best.choices), prediction=best.prediction,
                                       budget=solved.budget, exact=False,
                                       limited_by_quota=solved.limited_by_quota,
                                       unlimited_time_s=solved.unlimited_time_s,
                                       smallest_peak=solved.smallest_peak,
                                       kept_peak=solved.kept_peak)
        entry.measured = best.measured
        entry.verify = False
        self._log_plan(entry, f"chosen by measurement of {len(entry.trials)} candidates "
                              f"(measured {best.measured['time_s'] * 1e3:.1f} ms/step, peak "
                              f"{_planner.format_bytes(best.measured['peak'])})")

    def _probe(self, machine, sizes, step):
        """Stores and fetches tensors of these sizes through the stash, timed: the copy
        rates and the hook's cost per tensor. Tensors the engine would copy on the
        packing thread are probed one page above that size, through the copy engine: the
        model adds inline copies (at the store rate) to the compute thread itself. Three
        runs, the median of each figure: one run's rate on a loaded machine can be off
        by 2-4x, and the plan must not follow it."""
        if not step.cuda:
            sizes = [n if not _hooks.copied_inline(self.stash, n, False, False)
                     else _hooks.inline_bytes(self.stash) + 4096 for n in sizes]
        picked, total = [], 0
        for size in sorted(sizes, reverse=True):
            if total + size > _PROBE_BYTES and picked:
                break
            picked.append(size)
            total += size
        if not picked:
            return
        tensors = [torch.ones(max(1, size // 4), device=step.device) for size in picked]
        stash, runs = self.stash, []
        for _ in range(_PROBE_RUNS):
            stash.synchronize()
            start = time.perf_counter()
            saved = [_hooks.pack(stash, t, 0, boundary=False) for t in tensors]
            packed = time.perf_counter()
            stash.synchronize()
            stored = time.perf_counter()
            out = [_hooks.unpack(stash, s, check_version=False) for s in saved]
            if step.cuda:
                torch.cuda.synchronize(step.device)
            fetched = time.perf_counter()
            del out, saved
            stash.synchronize()
            runs.append(((packed - start) / len(picked), total / max(stored - start, 1e-9),
                         total / max(fetched - stored, 1e-9)))
        machine.per_tensor_s, machine.probe_store_bps, machine.probe_fetch_bps = (
            sorted(figure)[len(figure) // 2] for figure in zip(*runs))
        _apply_share(machine, self._ask_share(machine))

    def _ask_share(self, machine):
        """The daemon's copy share (Stash.copy_share), told what the probe saw alone."""
        self.share_asked = time.monotonic()
        finite = [r if r != float("inf") else 0.0
                  for r in (machine.probe_store_bps, machine.probe_fetch_bps)]
        return self.stash.copy_share(*finite)

    def _follow_share(self, entry):
        """About once a second (_SHARE_POLL_S) while a checked plan runs: asks the daemon
        for the copy share (which keeps this session counted as copying) and re-plans, to
        be checked at this step, when the rates it gives moved by more than
        _SHARE_CHANGE: other ranks started or stopped copying."""
        machine = entry.machine
        if machine is None or not machine.offload_allowed or \
                time.monotonic() - self.share_asked < _SHARE_POLL_S:
            return
        moved = dataclasses.replace(machine)
        _apply_share(moved, self._ask_share(machine))
        rates = (moved.store_bps, moved.fetch_bps)
        if rates == entry.share_refused or not any(
                abs(new - old) > _SHARE_CHANGE * old
                for new, old in zip(rates, (machine.store_bps, machine.fetch_bps))):
            _copy_share_fields(moved, machine)  # the report says what the daemon said
            return
        previous = (entry.machine, entry.plan)
        entry.machine = moved
        why = (f"re-planned (node copy share {_describe_share(moved)}, was "
               f"{_describe_share(machine)})")
        try:
            self._solve(entry, why, final=False)
        except BudgetError as error:
            # The share is a prediction: the plan that ran stays, and its checks decide.
            # Said once for these rates, not at every poll.
            entry.machine, entry.plan = previous
            entry.share_refused = rates
            _copy_share_fields(moved, machine)
            log.warning("actstash: %s; the plan stays: %s", why, error)
            return
        entry.share_refused = None
        if entry.plan.choices == previous[1].choices:
            # Same choices, new predictions: said once, and not measured again (that
            # plan was checked; a measured step costs its sampling and is slower).
            entry.verify = False
            self._log_plan(entry, why)

    def _solve(self, entry, why, final=True):
        """Solves for the entry's costs. BudgetError when no plan fits; `final`: the
        entry then refuses its budget for good (the error is logged and kept)."""
        try:
            plan = _planner.solve(entry.costs, entry.machine, entry.effective_budget,
                                  entry.stored_limit)
        except BudgetError as error:
            smallest = getattr(error, "smallest_peak", None)
            if final and smallest is not None and \
                    entry.effective_budget < smallest <= entry.budget:
                # Within the headroom the CPU's sampled memory asks for, not beyond the
                # budget: the plan of the smallest peak is measured (its check decides)
                # rather than the budget refused.
                log.info("actstash: %s; the plan of the smallest predicted peak (%s) is within "
                         "the budget of %s: measuring it", error,
                         _planner.format_bytes(smallest), _planner.format_bytes(entry.budget))
                plan = _planner.solve(entry.costs, entry.machine, smallest, entry.stored_limit)
                self._apply(entry, plan, why)
                return
            if not final:
                raise
            if entry.effective_budget != entry.budget:
                error = BudgetError(
                    f"{error} (the budget is {_planner.format_bytes(entry.budget)}; plans aim "
                    f"at {_planner.format_bytes(entry.effective_budget)}: "
                    + ("headroom for sampled memory" if not entry.corrections else
                       "a checked plan used more than predicted") + ")")
            entry.error = error
            log.warning("actstash: %s", error)
            raise error
        self._apply(entry, plan, why)

    def _apply(self, entry, plan, why):
        """`plan` runs from the next step, which checks it (3)."""
        changed = entry.plan is None or entry.plan.choices != plan.choices
        entry.plan, entry.verify = plan, True
        if changed:
            self._log_plan(entry, why)

    def _check(self, entry, step, peaks):
        blocks, _, _, step_s = self._phases(step, peaks)
        entry.measured = _measurement(step, peaks, blocks, step_s)
        peak = entry.measured["peak"]
        entry.verify = False
        target = _target(entry.budget, step.device)
        smallest = entry.plan.smallest_peak
        at_smallest = entry.plan.prediction.peak_bytes <= smallest
        if peak > target and entry.corrections < _MAX_CORRECTIONS and not at_smallest:
            # The model missed this much here: ask the next plan to leave that room, but
            # never aim below the smallest reachable peak before that plan was measured
            # (one step's miss must not refuse a budget that a plan may still meet).
            entry.corrections += 1
            entry.error_bytes = max(entry.error_bytes, peak - entry.plan.prediction.peak_bytes,
                                    peak - target)
            entry.effective_budget = max(target - entry.error_bytes, smallest)
            log.info("actstash: the plan reached %s, over the budget of %s (%s with headroom), "
                     "%s more than predicted: solving for %s%s", _planner.format_bytes(peak),
                     _planner.format_bytes(entry.budget), _planner.format_bytes(target),
                     _planner.format_bytes(peak - entry.plan.prediction.peak_bytes),
                     _planner.format_bytes(entry.effective_budget),
                     " (the smallest reachable peak)" if entry.effective_budget == smallest
                     else "")
            try:
                self._solve(entry, "corrected")
            except BudgetError:
                pass  # raised at the next step
        elif peak > target and at_smallest and peak <= entry.budget:
            log.info("actstash: the plan of the smallest predicted peak (%s) reached %s: within "
                     "the budget of %s, above the %s plans aim at (headroom for sampled memory); "
                     "it stays", _planner.format_bytes(smallest), _planner.format_bytes(peak),
                     _planner.format_bytes(entry.budget), _planner.format_bytes(target))
        elif peak > target and at_smallest:
            log.warning("actstash: the plan of the smallest predicted peak (%s) reached %s, over "
                        "the budget of %s (%s with headroom): no plan is predicted to hold less; "
                        "it stays", _planner.format_bytes(smallest), _planner.format_bytes(peak),
                        _planner.format_bytes(entry.budget), _planner.format_bytes(target))
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
        if entry is None:  # no step yet: what the first one does
            spec = self.budget_spec
            share = (isinstance(spec, (int, float)) and not isinstance(spec, bool)
                     and 0 < spec < 1) or (isinstance(spec, str) and spec.strip().endswith("%"))
            budget = (f"{spec if isinstance(spec, str) else f'a fraction {spec:g}'} of the free "
                      "memory, read at that step" if share else _planner.format_bytes(
                          _resolve_budget(spec, self.memory_limit, torch.device("cpu"))))
            first = "the first one records each block's ops, the next" if \
                _selective.supported() and not compiling() else "the first one"
            return PlanReport(_Entry(()), self.names, pending=(
                f"no step has run yet; {first} profiles the {len(self.blocks)} blocks "
                f"(their time, saved bytes and memory), then a plan is chosen for the "
                f"budget of {budget}"))
        return PlanReport(entry, self.names)


class PlanReport:
    """The plan of the latest input shape, as stash.plan() returns it: str() is a
    table; the attributes are the numbers."""

    def __init__(self, entry, names, pending=None):
        # Before the first step: why there is no plan yet, and what happens next
        # (every number below is None then). None once a step ran.
        self.pending = pending
        self.key = entry.key
        self.budget = entry.budget
        self.error = entry.error
        plan = entry.plan
        self.choices = list(plan.choices) if plan else None
        self.predicted_time_s = plan.prediction.time_s if plan else None
        self.predicted_peak = plan.prediction.peak_bytes if plan else None
        self.predicted_stored = plan.prediction.stored_bytes if plan else None  # in the stash
        self.exact = plan.exact if plan else None
        # The plan was checked and stays: the next step runs it unmeasured (until the
        # node's copy share or the input shape changes).
        self.settled = plan is not None and not entry.verify and entry.error is None
        self.limited_by_quota = plan.limited_by_quota if plan else False
        self.smallest_peak = plan.smallest_peak if plan else None  # predicted, any plan
        self.kept_peak = plan.kept_peak if plan else None  # predicted, every block kept
        measured = entry.measured
        same = measured is not None and plan is not None and measured["choices"] == plan.choices
        self.measured_time_s = measured["time_s"] if same else None
        self.measured_peak = measured["peak"] if same else None
        self.costs, self.machine, self.names = entry.costs, entry.machine, names
        m = entry.machine
        # The copy rates planned with and where they came from (Stash.copy_share).
        self.copy_rates = None if m is None or not m.offload_allowed else {
            "store_bps": m.store_bps, "fetch_bps": m.fetch_bps,
            "probe_store_bps": m.probe_store_bps, "probe_fetch_bps": m.probe_fetch_bps,
            "share_bps": m.share_bps, "node_bps": m.node_bps, "node_source": m.node_source,
            "copying_sessions": m.copying_sessions}
        self._plan, self._measured = plan, measured if same else None
        # The candidates measured after profiling (empty: none were): each one's
        # choices, predicted and measured step time and peak, and whether it was kept.
        self.candidates = [
            {"choices": list(t.choices), "predicted_time_s": t.prediction.time_s,
             "predicted_peak": t.prediction.peak_bytes,
             "predicted_peak_at_probed_rate": t.at_probed_rate.peak_bytes,
             "measured_time_s": t.measured["time_s"] if t.measured else None,
             "measured_peak": t.measured["peak"] if t.measured else None,
             "chosen": t is entry.chosen}
            for t in entry.trials or ()]
        # The plan is the candidate kept by measurement: its predicted peak counts the
        # copy safety factor and may exceed the budget; its measured peak did not, and
        # without the factor its prediction does not either.
        self.chosen_by_measurement = plan is not None and entry.chosen is not None and \
            entry.chosen.choices == plan.choices

    def __str__(self):
        mib = _planner.format_bytes
        if self.pending:
            return f"actstash plan: pending: {self.pending}"
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
            f"us/tensor (alone {self.machine.probe_store_bps / 1e9:.2f}/"
            f"{self.machine.probe_fetch_bps / 1e9:.2f} GB/s; node copy share "
            f"{_describe_share(self.machine)})"
            if self.machine.offload_allowed else "  stash: unavailable",
            f"  {'block':<20} {'saves':>10} {'choice':<19} {'fwd ms':>13} {'bwd ms':>13} "
            f"{'held':>10} {'peak':>21}",
        ]
        for j, (c, choice) in enumerate(zip(self.costs, self._plan.choices)):
            mb = m["blocks"][j] if m else None
            fwd = f"{p.forward_s[j] * 1e3:.1f}/" + (f"{mb['forward_s'] * 1e3:.1f}" if mb else "-")
            bwd = f"{p.backward_s[j] * 1e3:.1f}/" + (
                f"{mb['backward_s'] * 1e3:.1f}" if mb else "-")
            peak = f"{mib(p.phase_peak[j])}/" + (
                mib(max(mb["forward_peak"], mb["backward_peak"])) if mb else "-")
            lines.append(f"  {c.name[:20]:<20} {mib(c.saved_bytes):>10} {choice:<19} {fwd:>13} "
                         f"{bwd:>13} {mib(p.held[j]):>10} {peak:>21}")
        lines.append("  (fwd, bwd, peak: predicted/measured; held: kept until backward)")
        if self.candidates:
            lines.append("  candidates measured (step ms and peak: predicted/measured):")
            for c in self.candidates:
                measured = (f"{c['measured_time_s'] * 1e3:.1f}", mib(c["measured_peak"])) \
                    if c["measured_time_s"] is not None else ("-", "-")
                lines.append(f"  {'*' if c['chosen'] else ' '} "
                             f"{c['predicted_time_s'] * 1e3:.1f}/{measured[0]} ms, "
                             f"{mib(c['predicted_peak'])}/{measured[1]}: "
                             f"{', '.join(c['choices'])}")
        return "\n".join(lines)

    __repr__ = __str__


def _measurement(step, peaks, blocks, step_s):
    """One measured step as _Entry.measured (and a _Trial) keeps it."""
    return {"time_s": step_s, "peak": max(peaks.values(), default=0), "blocks": blocks,
            "choices": list(step.choices)}


def _apply_share(machine, share):
    """Plans with the smaller of the probe's rates and the node's copy share (the
    daemon's answer, or None: unknown) while other sessions copy too. Alone, the probe
    is the measurement of what this session gets; the node figure is an estimate."""
    node = (share or {}).get("node") or {}
    machine.share_bps = float((share or {}).get("share_bytes_per_second") or 0.0)
    machine.node_bps = float(node.get("node_bytes_per_second") or 0.0)
    machine.node_source = node.get("node_source") or ""
    machine.copying_sessions = int(node.get("copying_sessions") or 0)
    shared = machine.share_bps > 0 and machine.copying_sessions > 1
    cap = machine.share_bps if shared else float("inf")
    machine.store_bps = min(machine.probe_store_bps, cap)
    # Fetched in place (CPU views of the daemon's memory), a fetch copies nothing.
    machine.fetch_bps = machine.probe_fetch_bps if machine.fetched_in_place else \
        min(machine.probe_fetch_bps, cap)


def _copy_share_fields(source, machine):
    """The daemon's answer (not the rates planned with) from one Machine to another."""
    for field in ("share_bps", "node_bps", "node_source", "copying_sessions"):
        setattr(machine, field, getattr(source, field))


def _describe_share(machine):
    if machine.share_bps <= 0:
        return "unknown"
    if machine.copying_sessions <= 1:
        return (f"{machine.node_bps / 1e9:.2f} GB/s {machine.node_source}, copying alone: "
                f"the probe applies")
    return (f"{machine.share_bps / 1e9:.2f} GB/s: {machine.node_bps / 1e9:.2f} GB/s "
            f"{machine.node_source} over {machine.copying_sessions} copying sessions")


def _keep_smaller_working_sets(costs, machine, previous_costs, previous_machine):
    """Two profiles of the same plan: keeps each phase's smaller working set (a transient
    one step caught is not the model's); times stay those of the latest profile."""
    for cost, previous in zip(costs, previous_costs):
        cost.forward_work = min(cost.forward_work, previous.forward_work)
        cost.backward_work = min(cost.backward_work, previous.backward_work)
    machine.tail_work = min(machine.tail_work, previous_machine.tail_work)


def _target(budget, device):
    """What plans aim at: the budget, less headroom on the CPU (sampled memory)."""
    return budget if device.type == "cuda" else int(budget * (1 - _CPU_HEADROOM))


def _describe_key(key):
    return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')} {device}"
                     for shape, dtype, device in key) or "none"


def _resolve_budget(budget, memory_limit, device):
    """Bytes of a budget, by one rule: a number of 1 or more is bytes (6e9 too); a number
    below 1 is that fraction of the free memory; a string is a size ("6GiB", read as
    the daemon reads sizes) or a percentage of the free memory ("50%"). The free
    memory: the device's (CUDA), else memory_limit (CPU; default: MemAvailable)."""
    if isinstance(budget, bool) or budget is None:
        raise ValueError("policy='auto' needs budget=: bytes (6e9), a size like '6GiB', or a "
                         "share of the free memory (0.5, '50%')")
    if isinstance(budget, str):
        percent = budget.strip().endswith("%")
        return _planner.parse_bytes(budget, "budget",
                                    _free_bytes(memory_limit, device) if percent else 0)
    if isinstance(budget, (int, float)):
        if 0 < budget < 1:
            return int(budget * _free_bytes(memory_limit, device))
        if budget >= 1 and float(budget).is_integer():
            return int(budget)
    raise ValueError(f"budget: {budget!r} is neither a fraction below 1 of the free memory nor "
                     f"a whole number of bytes (or a size string: '6GiB', '50%')")


def _free_bytes(memory_limit, device):
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if memory_limit is not None:
        return (_planner.parse_bytes(memory_limit, "memory_limit")
                if isinstance(memory_limit, str) else int(memory_limit))
    return _mem_available()


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
