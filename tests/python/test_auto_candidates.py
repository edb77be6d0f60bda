"""The automatic plan measures before it commits (actstash._plan._planner.candidates,
actstash._plan._auto.AutoPlanner's trials), on synthetic costs and synthetic measured
steps: the candidates include the plan the model's safety factor on copies hid
and the fastest uniform plan that fits; after one measured step each, the fastest
candidate whose measured peak fits is kept (the solved plan unless another is more
than 3% faster), a faster one over the budget is not, and when none fits the
solved plan's step goes to the usual check. stash.plan()'s report lists them.
The same with a real daemon and model: test_auto_plan.py (every step bitwise,
budgets honored as measured) and bench/auto_plan_bench.py (auto against the best
uniform plan)."""
import types

import pytest
import torch

from actstash._plan import _auto
from actstash._plan._planner import (CHECKPOINT, CHECKPOINT_OFFLOAD, KEEP, OFFLOAD, BlockCost,
                                     Machine, candidates, simulate, solve,
                                     without_safety_factor)

MiB = 1 << 20
N = 4


def _costs():
    return [BlockCost(f"b{i}", forward_s=0.010, backward_s=0.020, saved_bytes=100 * MiB,
                      offload_bytes=100 * MiB, offload_tensors=10, largest_tensor=10 * MiB,
                      input_bytes=4 * MiB, input_offload_bytes=4 * MiB, input_tensors=1,
                      forward_work=20 * MiB, backward_work=120 * MiB) for i in range(N)]


def _machine():
    # 100 MiB stores at 8 GB/s take 13 ms, longer than a block's 10 ms forward: the
    # safety factor (store_slowdown 2) counts more sources in flight.
    return Machine(store_bps=8e9, fetch_bps=8e9, per_tensor_s=20e-6, tail_s=0.005,
                   tail_work=MiB, max_in_flight_bytes=float("inf"))


def _budget_only_the_optimistic_count_meets():
    costs, machine = _costs(), _machine()
    careful = simulate(costs, machine, [OFFLOAD] * N).peak_bytes
    optimistic = simulate(costs, without_safety_factor(machine), [OFFLOAD] * N).peak_bytes
    assert optimistic < careful  # the case the safety factor hides
    return optimistic


def test_candidates_include_the_plan_the_safety_factor_hid():
    costs, machine = _costs(), _machine()
    budget = _budget_only_the_optimistic_count_meets()
    plan = solve(costs, machine, budget)
    assert plan.choices != [OFFLOAD] * N  # not predicted to fit with the factor
    found = candidates(costs, machine, plan)
    assert found[0] == plan.choices
    assert [OFFLOAD] * N in found
    assert 2 <= len(found) <= 3 and len({tuple(c) for c in found}) == len(found)
    optimistic = without_safety_factor(machine)
    for choices in found:
        assert simulate(costs, optimistic, choices).peak_bytes <= budget
    assert candidates(costs, machine, plan, limit=1) == [plan.choices]


def test_with_room_for_everything_the_only_candidate_is_keep():
    costs, machine = _costs(), _machine()
    plan = solve(costs, machine, 10 << 30)
    assert plan.choices == [KEEP] * N
    assert candidates(costs, machine, plan) == [[KEEP] * N]


def _planner_with_trials(budget, limit=3):
    planner = _auto.AutoPlanner(stash=None, blocks=[], names=[f"b{i}" for i in range(N)],
                                budget=budget, memory_limit=None, min_bytes=0,
                                candidates=limit)
    entry = _auto._Entry(key=())
    entry.budget = budget
    entry.effective_budget = _auto._target(budget, torch.device("cpu"))
    entry.costs, entry.machine = _costs(), _machine()
    planner.entries[()] = planner.current = entry
    planner._solve(entry, "profiled")
    planner._plan_trials(entry)
    return planner, entry


def _measured_step(choices, step_s, peak):
    """A measured step of `choices` that took step_s and peaked at `peak`."""
    phases = [("f", j) for j in range(N)] + [("g", j) for j in range(N)]
    phases += [("b", j) for j in range(N)] + ["end"]
    times = {p: step_s * k / (len(phases) - 1) for k, p in enumerate(phases)}
    step = types.SimpleNamespace(n=N, times=times, device=torch.device("cpu"),
                                 choices=list(choices))
    return step, {("f", 0): peak}


def _run_trials(planner, entry, outcomes):
    """outcomes: per candidate, (step seconds, peak)."""
    assert entry.trials is not None and len(outcomes) == len(entry.trials)
    for trial, (step_s, peak) in zip(entry.trials, outcomes):
        assert entry.verify  # not settled while candidates are measured
        planner._trial_done(entry, *_measured_step(trial.choices, step_s, peak))


def test_the_fastest_candidate_that_fits_as_measured_is_kept():
    budget = _budget_only_the_optimistic_count_meets()
    planner, entry = _planner_with_trials(budget)
    solved = list(entry.plan.choices)
    fits = int(_auto._target(budget, torch.device("cpu")) * 0.9)
    outcomes = [(0.200, fits)] + [(0.150, fits)] * (len(entry.trials) - 1)
    _run_trials(planner, entry, outcomes)
    assert entry.chosen is entry.trials[1] and entry.plan.choices == entry.trials[1].choices
    assert entry.plan.choices != solved and not entry.verify and entry.error is None
    report = _auto.PlanReport(entry, planner.names)
    assert report.settled and report.measured_time_s == pytest.approx(0.150)
    assert [c["chosen"] for c in report.candidates] == \
        [False, True] + [False] * (len(entry.trials) - 2)
    assert report.candidates[0]["measured_time_s"] == pytest.approx(0.200)
    assert report.chosen_by_measurement
    for c in report.candidates:  # every candidate fits without the safety factor
        assert c["predicted_peak_at_probed_rate"] <= budget
    assert "candidates measured" in str(report)


def test_a_faster_candidate_over_the_budget_is_not_kept():
    budget = _budget_only_the_optimistic_count_meets()
    planner, entry = _planner_with_trials(budget)
    target = _auto._target(budget, torch.device("cpu"))
    outcomes = [(0.200, target - MiB)] + [(0.100, target + MiB)] * (len(entry.trials) - 1)
    _run_trials(planner, entry, outcomes)
    assert entry.chosen is entry.trials[0] and not entry.verify


def test_within_the_margin_the_solved_plan_stays():
    budget = _budget_only_the_optimistic_count_meets()
    planner, entry = _planner_with_trials(budget)
    fits = int(_auto._target(budget, torch.device("cpu")) * 0.9)
    outcomes = [(0.200, fits)] + [(0.196, fits)] * (len(entry.trials) - 1)  # 2% faster
    _run_trials(planner, entry, outcomes)
    assert entry.chosen is entry.trials[0]
    assert entry.plan.choices == entry.trials[0].choices


def test_when_none_fits_the_solved_plan_is_checked_and_corrected():
    budget = _budget_only_the_optimistic_count_meets()
    planner, entry = _planner_with_trials(budget)
    solved = list(entry.plan.choices)
    over = _auto._target(budget, torch.device("cpu")) + 8 * MiB
    _run_trials(planner, entry, [(0.100, over)] * len(entry.trials))
    assert entry.chosen is None and entry.corrections == 1
    assert entry.verify and entry.plan.choices != solved  # a corrected plan, to be checked
    # Later steps are checked as before, not measured as candidates again.
    assert entry.trial_index == len(entry.trials)


def test_one_candidate_means_no_trials():
    budget = _budget_only_the_optimistic_count_meets()
    _, entry = _planner_with_trials(budget, limit=1)
    assert entry.trials is None and entry.verify


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_candidates_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="candidates"):
        _auto.AutoPlanner(stash=None, blocks=[], names=[], budget=1 << 30, memory_limit=None,
                          min_bytes=0, candidates=bad)


def test_every_candidate_is_a_known_choice():
    costs, machine = _costs(), _machine()
    plan = solve(costs, machine, _budget_only_the_optimistic_count_meets())
    for choices in candidates(costs, machine, plan):
        assert set(choices) <= {KEEP, OFFLOAD, CHECKPOINT, CHECKPOINT_OFFLOAD}


class _Share:
    """A stash whose node copy share the test sets."""

    def __init__(self, share_bps, sessions):
        self.share_bps, self.sessions = share_bps, sessions

    def copy_share(self, store_bps, fetch_bps):
        return {"share_bytes_per_second": self.share_bps,
                "node": {"node_bytes_per_second": self.share_bps * self.sessions,
                         "node_source": "test", "copying_sessions": self.sessions}}


def test_a_new_share_that_changes_nothing_costs_no_measured_step():
    planner, entry = _planner_with_trials(10 << 30)  # everything fits: keep
    assert entry.trials is None and entry.plan.choices == [KEEP] * N
    entry.verify = False  # checked
    entry.machine.probe_store_bps = entry.machine.probe_fetch_bps = 8e9
    planner.stash = _Share(share_bps=1e9, sessions=4)  # other ranks start copying
    planner._follow_share(entry)
    assert entry.machine.store_bps == 1e9  # re-planned with the share...
    assert entry.plan.choices == [KEEP] * N and not entry.verify  # ...nothing to check


def test_a_new_share_that_changes_the_plan_is_checked():
    budget = _budget_only_the_optimistic_count_meets()
    planner, entry = _planner_with_trials(budget, limit=1)
    entry.verify = False
    before = list(entry.plan.choices)
    entry.machine.probe_store_bps = entry.machine.probe_fetch_bps = 8e9
    planner.stash = _Share(share_bps=0.2e9, sessions=8)  # copies 40x slower: re-plan
    planner._follow_share(entry)
    assert entry.plan.choices != before and entry.verify


def test_a_candidate_kept_by_measurement_still_says_the_quota_limited_the_plan():
    """The quota limits every candidate (each is solved within it): when another
    candidate than the solved plan wins its measurement, the plan and its report still
    say that a faster plan exists which the quota does not allow."""
    budget = _budget_only_the_optimistic_count_meets()
    planner = _auto.AutoPlanner(stash=None, blocks=[], names=[f"b{i}" for i in range(N)],
                                budget=budget, memory_limit=None, min_bytes=0, candidates=3)
    entry = _auto._Entry(key=())
    entry.budget = budget
    entry.effective_budget = _auto._target(budget, torch.device("cpu"))
    entry.costs, entry.machine = _costs(), _machine()
    entry.stored_limit = 60 * MiB  # less than one block's offload
    planner.entries[()] = planner.current = entry
    planner._solve(entry, "profiled")
    assert entry.plan.limited_by_quota
    planner._plan_trials(entry)
    assert entry.trials is not None and len(entry.trials) >= 2
    fits = int(entry.effective_budget * 0.9)
    _run_trials(planner, entry, [(0.200, fits)] + [(0.150, fits)] * (len(entry.trials) - 1))
    assert entry.chosen is entry.trials[1]
    report = _auto.PlanReport(entry, planner.names)
    assert report.limited_by_quota and report.chosen_by_measurement
    assert report.predicted_stored <= entry.stored_limit
    assert "limited by the quota" in str(report)
