"""The automatic plan's correction after a checked step measured more than
predicted (actstash._plan._auto.AutoPlanner._check), on synthetic costs: the corrected
aim never goes below the smallest reachable peak before the plan of that peak was
tried, and that plan, measured over the budget, stays with a warning instead of
refusing the budget."""
import logging
import types

import torch

from actstash._plan import _auto
from actstash._plan._planner import KEEP, BlockCost, Machine

MiB = 1 << 20


def _costs():
    return [BlockCost(f"b{i}", forward_s=0.010, backward_s=0.020, saved_bytes=40 * MiB,
                      offload_bytes=40 * MiB, offload_tensors=4, largest_tensor=10 * MiB,
                      input_bytes=4 * MiB, input_offload_bytes=4 * MiB, input_tensors=1,
                      forward_work=8 * MiB, backward_work=48 * MiB) for i in range(3)]


def _planner_with_plan(budget):
    planner = _auto.AutoPlanner(stash=None, blocks=[], names=["b0", "b1", "b2"],
                                budget=budget, memory_limit=None, min_bytes=0)
    entry = _auto._Entry(key=())
    entry.budget = budget
    entry.effective_budget = _auto._target(budget, torch.device("cpu"))
    entry.costs = _costs()
    entry.machine = Machine(store_bps=10e9, fetch_bps=10e9, per_tensor_s=20e-6, tail_s=0.005,
                            tail_work=MiB)
    planner.entries[()] = planner.current = entry
    planner._solve(entry, "profiled")
    return planner, entry


def _checked_step(entry, peak):
    """A measured step of the entry's plan whose phases took 1 ms each and whose peak
    was `peak`."""
    n = len(entry.costs)
    phases = [("f", j) for j in range(n)] + [("g", j) for j in range(n)]
    phases += [("b", j) for j in range(n)] + ["end"]
    times = {p: 0.001 * k for k, p in enumerate(phases)}
    step = types.SimpleNamespace(n=n, times=times, device=torch.device("cpu"),
                                 choices=list(entry.plan.choices))
    return step, {("f", 0): peak}


def test_a_miss_never_aims_below_the_smallest_peak_before_trying_its_plan(caplog):
    caplog.set_level("INFO", logger="actstash")
    planner, entry = _planner_with_plan(budget=150 * MiB)
    first = entry.plan
    assert first.prediction.peak_bytes > first.smallest_peak  # not the smallest plan
    # A step measured far over: budget less the miss is below the smallest peak.
    target = _auto._target(entry.budget, torch.device("cpu"))
    miss = target - first.smallest_peak + 30 * MiB
    step, peaks = _checked_step(entry, first.prediction.peak_bytes + miss)
    planner._check(entry, step, peaks)
    assert entry.error is None  # not refused: the smallest plan is tried first
    assert entry.effective_budget == first.smallest_peak
    assert entry.plan.prediction.peak_bytes == first.smallest_peak
    assert entry.plan.choices != first.choices and entry.verify
    assert "(the smallest reachable peak)" in caplog.text
    # That plan, measured over the budget as well: it stays, with a warning.
    smallest_plan = entry.plan
    step, peaks = _checked_step(entry, target + 10 * MiB)
    planner._check(entry, step, peaks)
    assert entry.error is None and entry.plan is smallest_plan
    assert entry.corrections == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no plan is predicted to hold less" in r.getMessage() for r in warnings)


def test_a_miss_within_reach_corrects_by_what_the_model_missed():
    planner, entry = _planner_with_plan(budget=150 * MiB)
    first = entry.plan
    target = _auto._target(entry.budget, torch.device("cpu"))
    step, peaks = _checked_step(entry, target + 4 * MiB)
    planner._check(entry, step, peaks)
    miss = target + 4 * MiB - first.prediction.peak_bytes
    assert entry.effective_budget == target - max(miss, 4 * MiB) > first.smallest_peak
    assert entry.plan.prediction.peak_bytes <= entry.effective_budget
    assert entry.plan.choices != [KEEP] * 3 and entry.error is None


def test_a_budget_within_the_headroom_of_the_smallest_peak_measures_that_plan(caplog):
    """On the CPU plans aim at 95% of the budget (sampled memory misses short peaks).
    A budget whose 95% is below the smallest predicted peak, but not the budget
    itself, is not refused: the plan of that peak runs and its check decides."""
    caplog.set_level("INFO", logger="actstash")
    planner, entry = _planner_with_plan(budget=1 << 40)
    smallest = entry.plan.smallest_peak
    for budget, refused in ((smallest + smallest // 40, False), (smallest - 1, True)):
        entry.plan, entry.error = None, None
        entry.budget = budget
        entry.effective_budget = _auto._target(budget, torch.device("cpu"))
        assert entry.effective_budget < smallest
        try:
            planner._solve(entry, "profiled")
        except _auto.BudgetError:
            assert refused and entry.error is not None
            continue
        assert not refused
        assert entry.plan.prediction.peak_bytes == smallest and entry.verify
        assert "is within the budget" in caplog.text
        # Its check measures it above the aim but within the budget: it stays, no warning.
        chosen = entry.plan
        planner._check(entry, *_checked_step(entry, (entry.effective_budget + budget) // 2))
        assert entry.plan is chosen and entry.error is None and not entry.verify
        assert "within the budget" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
