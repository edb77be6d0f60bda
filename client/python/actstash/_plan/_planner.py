"""The automatic plan's model and solver: per block keep, offload, checkpoint,
checkpoint+offload, selective or selective+offload (per op: the outputs of the
ops that cost most per byte to recompute are kept, or offloaded, and the rest is
recomputed; _selective), chosen to minimize the predicted step time with the predicted
peak memory of the step within a budget. Pure Python (no torch): the profiler
(_auto.py) measures the costs, this module predicts and chooses.

The model of one training step (all times in seconds, memory in bytes):

* Forward runs the blocks in order on one compute timeline. A block takes its
  forward time, plus a per-tensor hook cost for each tensor it stores, plus the
  copies the engine makes on the packing thread (small CPU tensors and a
  checkpoint boundary's CPU input: `BlockCost.*_inline_bytes`), which are done
  when the hook returns and are never in flight. The other stores go
  to one copy queue at the measured store throughput: a store starts when its
  block's forward ends and the queue is free, so it costs nothing while it hides
  behind the compute of the blocks after it, and its source stays in memory
  until it is copied. For memory (a budget is a promise) the copy counts as
  slower than probed, by `Machine.store_slowdown`: on a loaded machine the
  probed throughput of one model varies 2-4x between profiles, and a store
  predicted to end just before the next boundary must not make the predicted
  peak jump between two levels from one profile to the next. The engine bounds
  the sources in flight (`Machine.max_in_flight_bytes`): a block whose stores
  would leave more than that waiting in the queue waits (compute-thread time)
  until the oldest copies are done, and no more than that is ever counted in
  flight.
* Between the last block's forward and its backward: the tail (head, loss, and
  their backward), measured.
* Backward runs the blocks in reverse. A block's backward cannot start before its
  stores finished (it reads them). Its duration is its backward compute, plus its
  forward time again when it recomputes, or the time to fetch its stored bytes
  when that is longer (fetches are prefetched a few tensors ahead, so they
  overlap the block's own compute); a checkpoint+offload or selective+offload
  block first fetches what it stored, then recomputes; a selective block
  recomputes only its other ops (its measured recomputation times the share of
  its op time those ops took in the op profile).
* Memory held across blocks: keep holds what the block saves for backward,
  offload only what is too small to store, checkpoint the block's input,
  checkpoint+offload only an input too small to store, selective the input and the
  saved ops' outputs, selective+offload only what of those is too small to store.
  A block's forward phase adds its transient working memory (or what it holds,
  if larger) and the sources of stores still in flight when it ends; its
  backward phase adds its measured backward working set (what it saved or
  recomputes, plus gradients and temporaries; less what an offloaded block reads
  in place, where the stash hands out views of its memory) and what is
  prefetched for the block before it. The peak is the largest of these over the
  step, relative to what the trainer holds when the
  first block starts.

The solver is exact: a depth-first branch and bound over the 4^n (6^n with an op
profile) plans, pruned by
two lower bounds (time: the rest of the blocks kept, which no other choice makes
faster; memory: the rest held at their smallest), started from a greedy plan. Past
`max_nodes` visited plans (models of more than about ten blocks, at budgets
between the extremes) it returns the best plan found, at least as fast as the
greedy one, and says it is not proven optimal (`Plan.exact` False).
"""
import dataclasses
from typing import Optional

from actstash._errors import BudgetError

KEEP, OFFLOAD, CHECKPOINT, CHECKPOINT_OFFLOAD = (
    "keep", "offload", "checkpoint", "checkpoint+offload")
# Per op inside a checkpointed block (_selective): the outputs of the ops that cost the
# most per byte to recompute are kept in the trainer (selective: the input kept too, as
# torch's SAC) or offloaded with the input (selective+offload); the rest is recomputed.
SELECTIVE, SELECTIVE_OFFLOAD = "selective", "selective+offload"
CHOICES = (KEEP, OFFLOAD, CHECKPOINT, CHECKPOINT_OFFLOAD, SELECTIVE, SELECTIVE_OFFLOAD)
_STORES = (OFFLOAD, CHECKPOINT_OFFLOAD, SELECTIVE_OFFLOAD)
_RECOMPUTES = (CHECKPOINT, CHECKPOINT_OFFLOAD, SELECTIVE, SELECTIVE_OFFLOAD)
_FETCH_FIRST = (CHECKPOINT_OFFLOAD, SELECTIVE_OFFLOAD)  # fetch, then recompute


@dataclasses.dataclass
class BlockCost:
    """What one block costs, as measured (or, in tests, given)."""
    name: str
    forward_s: float          # forward compute
    backward_s: float         # backward compute, without recomputation
    saved_bytes: int          # held in-process when kept: the storages saved for backward
    offload_bytes: int = 0    # what offloading stores (saved tensors of >= min_bytes)
    offload_tensors: int = 0
    largest_tensor: int = 0   # the largest of those
    input_bytes: int = 0      # the block's tensor inputs: what checkpoint holds
    input_offload_bytes: int = 0  # of those, what checkpoint+offload stores
    input_tensors: int = 0
    # Of offload_bytes / input_offload_bytes: what the engine copies on the packing
    # thread (small CPU tensors, and a checkpoint boundary's CPU input): done when its
    # hook returns, never in flight; its copy is compute-thread time.
    offload_inline_bytes: int = 0
    input_inline_bytes: int = 0
    forward_work: int = 0     # transient memory of its forward, above what is held
    backward_work: int = 0    # its backward's working set, above what is held
    recompute_s: Optional[float] = None  # recomputation (default: forward_s)
    # The selective choices (from the op profile; None: not profiled): what the saved
    # ops' outputs hold, what offloading them stores (outputs of >= min_bytes), of that
    # what is copied on the packing thread, and the recomputation of the other ops.
    selective_recompute_s: Optional[float] = None
    selective_bytes: int = 0
    selective_offload_bytes: int = 0
    selective_tensors: int = 0
    selective_inline_bytes: int = 0

    def held(self, choice):
        if choice == KEEP:
            return self.saved_bytes
        if choice == OFFLOAD:
            return max(0, self.saved_bytes - self.offload_bytes)
        if choice == CHECKPOINT:
            return self.input_bytes
        if choice == SELECTIVE:
            return self.input_bytes + self.selective_bytes
        kept_input = max(0, self.input_bytes - self.input_offload_bytes)
        if choice == SELECTIVE_OFFLOAD:
            return kept_input + max(0, self.selective_bytes - self.selective_offload_bytes)
        return kept_input

    def recompute_of(self, choice):
        """The recomputation backward runs under `choice` (0 if none)."""
        if choice in (SELECTIVE, SELECTIVE_OFFLOAD) and self.selective_recompute_s is not None:
            return self.selective_recompute_s
        if choice in _RECOMPUTES:  # without an op profile, selective recomputes it all
            return self.recompute_s if self.recompute_s is not None else self.forward_s
        return 0.0

    def backward_work_of(self, choice, machine):
        """The backward working set under `choice`: offloaded tensors read in place
        are the daemon's memory, not the trainer's."""
        if choice == OFFLOAD and machine.fetched_in_place:
            return max(0, self.backward_work - min(self.saved_bytes, self.offload_bytes))
        return self.backward_work

    def stored(self, choice):
        """(bytes, tensors) a choice sends to the stash."""
        if choice == OFFLOAD:
            return self.offload_bytes, self.offload_tensors
        if choice == CHECKPOINT_OFFLOAD:
            return self.input_offload_bytes, self.input_tensors
        if choice == SELECTIVE_OFFLOAD:
            return (self.input_offload_bytes + self.selective_offload_bytes,
                    self.input_tensors + self.selective_tensors)
        return 0, 0

    def stored_inline(self, choice):
        """Of what a choice stores, the bytes copied on the packing thread."""
        if choice == OFFLOAD:
            return min(self.offload_inline_bytes, self.offload_bytes)
        if choice == CHECKPOINT_OFFLOAD:
            return min(self.input_inline_bytes, self.input_offload_bytes)
        if choice == SELECTIVE_OFFLOAD:
            return (min(self.input_inline_bytes, self.input_offload_bytes) +
                    min(self.selective_inline_bytes, self.selective_offload_bytes))
        return 0


@dataclasses.dataclass
class Machine:
    """What the step costs outside the blocks, and what the stash reaches."""
    store_bps: float = float("inf")   # store throughput (bytes/s)
    fetch_bps: float = float("inf")   # fetch throughput
    per_tensor_s: float = 0.0         # compute-thread cost of storing one tensor
    prefetch: int = 2                 # tensors fetched ahead in backward
    tail_s: float = 0.0               # after the last block's forward, before its backward
    tail_work: int = 0                # memory the tail adds above what is held
    offload_allowed: bool = True      # False without a stash: keep and checkpoint only
    fetched_in_place: bool = False    # backward reads offloaded tensors in place (CPU views
    #                                   of the daemon's memory): they add nothing in-process
    store_slowdown: float = 2.0       # for memory only: copies take this much longer than
    #                                   store_bps says before their sources count as freed
    max_in_flight_bytes: float = 0    # the engine's bound on sources in flight; 0: none
    # What store_bps and fetch_bps were taken from: the probe alone, and the node's copy
    # share (the daemon's node bandwidth over the sessions copying at once; 0: unknown).
    # The rates planned with are the smaller of the two.
    probe_store_bps: float = float("inf")
    probe_fetch_bps: float = float("inf")
    share_bps: float = 0.0
    node_bps: float = 0.0
    node_source: str = ""
    copying_sessions: int = 0
    selective_allowed: bool = False   # every block has an op profile (BlockCost.selective_*)


@dataclasses.dataclass
class Prediction:
    time_s: float
    peak_bytes: int
    stored_bytes: int      # in the stash at the end of forward
    forward_s: list        # per block
    backward_s: list
    held: list
    phase_peak: list       # per block: the larger of its forward and backward phase


def simulate(costs, machine, plan):
    """The predicted time and memory of one step under `plan` (a choice per block)."""
    n = len(costs)
    t = 0.0
    copy_free = 0.0
    slow_copy_free = 0.0  # the same queue at store_bps / store_slowdown: for memory
    store_done = [0.0] * n
    in_flight = []  # (source freed at, with the slow queue; source bytes)
    bound = machine.max_in_flight_bytes or float("inf")
    biggest = 0  # the largest single store so far: it may be in flight alone
    held_prefix = [0] * (n + 1)
    held = [c.held(choice) for c, choice in zip(costs, plan)]
    stored = 0
    fwd, bwd, phase_peak = [0.0] * n, [0.0] * n, [0] * n
    for j, (c, choice) in enumerate(zip(costs, plan)):
        start = t
        nbytes, ntensors = c.stored(choice)
        inline = c.stored_inline(choice)
        queued = nbytes - inline
        t += c.forward_s + ntensors * machine.per_tensor_s + inline / machine.store_bps
        # At its end (what it holds is all there), with the stores still copying.
        flying = min(max(bound, biggest), sum(b for done, b in in_flight if done > t))
        phase_peak[j] = held_prefix[j] + flying + max(c.forward_work, held[j])
        if queued:
            begin = max(copy_free, t)
            copy_free = begin + queued / machine.store_bps
            store_done[j] = copy_free
            # The packing thread waits for the oldest copies while more than the bound
            # would be in flight; a single store larger than the bound goes alone.
            one = c.largest_tensor if choice == OFFLOAD and c.largest_tensor else (
                queued / max(ntensors, 1))
            biggest = max(biggest, one)
            left = max(bound, one)  # in flight once the packing thread may go on
            backlog = (copy_free - t) * machine.store_bps
            queued_at = t
            if backlog > left:
                t += (backlog - left) / machine.store_bps
            slow_copy_free = max(slow_copy_free, queued_at) + (
                queued * machine.store_slowdown / machine.store_bps)
            in_flight.append((slow_copy_free, queued))
        stored += nbytes
        fwd[j] = t - start
        held_prefix[j + 1] = held_prefix[j] + held[j]
    t += machine.tail_s
    flying = min(max(bound, biggest),
                 sum(b for done, b in in_flight if done > t))  # at its end, as for blocks
    peak = held_prefix[n] + flying + machine.tail_work
    for j in range(n - 1, -1, -1):
        c, choice = costs[j], plan[j]
        start = max(t, store_done[j])
        compute = c.backward_s + c.recompute_of(choice)
        nbytes, _ = c.stored(choice)
        fetch = nbytes / machine.fetch_bps if nbytes else 0.0
        duration = fetch + compute if choice in _FETCH_FIRST else max(compute, fetch)
        bwd[j] = start + duration - t  # with any wait for its stores
        t = start + duration
        ahead = 0
        if j > 0 and plan[j - 1] in _STORES and not machine.fetched_in_place:
            before, ahead_tensors = costs[j - 1].stored(plan[j - 1])
            ahead = min(before, machine.prefetch * max(costs[j - 1].largest_tensor,
                                                       before // max(ahead_tensors, 1)))
        phase_peak[j] = max(phase_peak[j],
                            held_prefix[j] + c.backward_work_of(choice, machine) + ahead)
    return Prediction(time_s=t, peak_bytes=max([peak] + phase_peak), stored_bytes=stored,
                      forward_s=fwd, backward_s=bwd, held=held, phase_peak=phase_peak)


@dataclasses.dataclass
class Plan:
    """A solved plan: the choice per block, what the model predicts for it, and why."""
    choices: list
    prediction: Prediction
    budget: int
    exact: bool = True           # proven optimal under the model
    limited_by_quota: bool = False  # a faster plan exists that the quota does not allow
    unlimited_time_s: Optional[float] = None  # that faster plan's predicted time
    nodes: int = 0                # plans the search visited
    smallest_peak: int = 0        # the least peak any plan reaches
    kept_peak: int = 0            # the peak with every block kept


class _Stop(Exception):
    pass


def _fits(prediction, budget, stored_limit):
    return prediction.peak_bytes <= budget and prediction.stored_bytes <= stored_limit


def _allowed(machine):
    allowed = CHOICES if machine.offload_allowed else (KEEP, CHECKPOINT, SELECTIVE)
    return allowed if machine.selective_allowed else tuple(
        c for c in allowed if c not in (SELECTIVE, SELECTIVE_OFFLOAD))


def _min_held(c, machine):
    return min(c.held(choice) for choice in _allowed(machine))


def _min_backward_work(c, machine):
    return min(c.backward_work_of(choice, machine) for choice in _allowed(machine))


def _bounds(costs, machine, prefix):
    """Lower bounds on (time, peak, stored bytes) over every plan that starts with prefix."""
    n, k = len(costs), len(prefix)
    partial = simulate(costs, machine, list(prefix) + [KEEP] * (n - k))
    time_lb = partial.time_s
    peak_lb = max(partial.phase_peak[:k], default=0)
    held = sum(partial.held[:k])
    for c in costs[k:]:
        least = _min_held(c, machine)
        peak_lb = max(peak_lb, held + max(c.forward_work, _min_backward_work(c, machine), least))
        held += least
    peak_lb = max(peak_lb, held + machine.tail_work)
    stored_lb = sum(c.stored(choice)[0] for c, choice in zip(costs, prefix))
    return time_lb, peak_lb, stored_lb


def _search(costs, machine, objective, budget, stored_limit, incumbent, max_nodes):
    """Branch and bound: the feasible plan of least `objective` ("time" or "peak").
    Returns (plan or None, prediction, exact, nodes)."""
    n = len(costs)
    order = [c for c in (KEEP, OFFLOAD, SELECTIVE, SELECTIVE_OFFLOAD, CHECKPOINT_OFFLOAD,
                         CHECKPOINT) if c in _allowed(machine)]
    if objective == "peak":
        order.reverse()

    def value(prediction):
        return prediction.time_s if objective == "time" else prediction.peak_bytes

    best = {"plan": None, "prediction": None, "value": float("inf")}
    if incumbent is not None:
        prediction = simulate(costs, machine, incumbent)
        if _fits(prediction, budget, stored_limit):
            best.update(plan=list(incumbent), prediction=prediction, value=value(prediction))
    nodes = 0

    def visit(prefix):
        nonlocal nodes
        nodes += 1
        if nodes > max_nodes:
            raise _Stop
        if len(prefix) == n:
            prediction = simulate(costs, machine, prefix)
            if _fits(prediction, budget, stored_limit) and value(prediction) < best["value"]:
                best.update(plan=list(prefix), prediction=prediction, value=value(prediction))
            return
        time_lb, peak_lb, stored_lb = _bounds(costs, machine, prefix)
        if peak_lb > budget or stored_lb > stored_limit:
            return
        if (time_lb if objective == "time" else peak_lb) >= best["value"]:
            return
        for choice in order:
            visit(prefix + [choice])

    exact = True
    try:
        visit([])
    except _Stop:
        exact = False
    return best["plan"], best["prediction"], exact, nodes


def _greedy(costs, machine, budget, stored_limit):
    """A feasible plan to start the search from: everything at its smallest, then the
    change of one block that saves the most time while it fits, until none does."""
    plan = [min(_allowed(machine), key=c.held) for c in costs]
    if not _fits(simulate(costs, machine, plan), budget, stored_limit):
        return None
    return _improve(costs, machine, budget, stored_limit, plan, pairs=False)


def _improve(costs, machine, budget, stored_limit, plan, pairs=True):
    """Local search from `plan`: the best change of one block's choice (or of two
    blocks', with `pairs`) that fits and is faster, until none is."""
    n, choices = len(costs), _allowed(machine)
    current = simulate(costs, machine, plan)
    while True:
        best = None
        for i in range(n):
            for j in range(i, n if pairs else i + 1):
                for a in choices:
                    for b in (choices if j > i else (a,)):
                        candidate = list(plan)
                        candidate[i], candidate[j] = a, b
                        if candidate == plan:
                            continue
                        p = simulate(costs, machine, candidate)
                        if _fits(p, budget, stored_limit) and p.time_s < (best or current).time_s:
                            best, best_plan = p, candidate
        if best is None:
            return plan
        plan, current = best_plan, best


def _simplify(costs, machine, budget, stored_limit, plan):
    """Among plans of equal predicted time, the one that keeps more and stores less:
    each block moves to an earlier choice of CHOICES (keep, offload, checkpoint,
    checkpoint+offload, selective, selective+offload) when that costs no time and still fits."""
    plan = list(plan)
    current = simulate(costs, machine, plan)
    for j in range(len(plan)):
        for choice in _allowed(machine):
            if choice == plan[j]:
                break
            candidate = plan[:j] + [choice] + plan[j + 1:]
            p = simulate(costs, machine, candidate)
            if p.time_s <= current.time_s and _fits(p, budget, stored_limit):
                plan, current = candidate, p
                break
    return plan


def solve(costs, machine, budget, stored_limit=float("inf"), max_nodes=20_000):
    """The plan of least predicted step time whose predicted peak is within `budget`
    and whose stored bytes are within `stored_limit` (the session's quota). Raises
    BudgetError, with the smallest reachable peak, when no plan fits."""
    if not costs:
        raise ValueError("no blocks to plan")
    smallest, smallest_prediction, _, _ = _search(costs, machine, "peak", float("inf"),
                                                  stored_limit, None, max_nodes)
    if smallest is None or smallest_prediction.peak_bytes > budget:
        error = BudgetError(_infeasible_message(costs, machine, budget, stored_limit,
                                                smallest, smallest_prediction))
        # The least peak any plan within the quota reaches (None: none is within it).
        error.smallest_peak = smallest_prediction.peak_bytes if smallest else None
        raise error
    plan, prediction, exact, nodes = _search(costs, machine, "time", budget, stored_limit,
                                             _greedy(costs, machine, budget, stored_limit),
                                             max_nodes)
    if not exact:
        plan = _improve(costs, machine, budget, stored_limit, plan)
    plan = _simplify(costs, machine, budget, stored_limit, plan)
    prediction = simulate(costs, machine, plan)
    result = Plan(choices=plan, prediction=prediction, budget=budget, exact=exact, nodes=nodes,
                  smallest_peak=smallest_prediction.peak_bytes,
                  kept_peak=simulate(costs, machine, [KEEP] * len(costs)).peak_bytes)
    if stored_limit != float("inf"):
        free, free_prediction, _, _ = _search(costs, machine, "time", budget, float("inf"),
                                              plan, max_nodes)
        if free_prediction is not None and free_prediction.time_s < prediction.time_s:
            result.limited_by_quota = True
            result.unlimited_time_s = free_prediction.time_s
    return result


def without_safety_factor(machine):
    """`machine` with copies counted at the probed rate for memory too
    (store_slowdown 1): the model a candidate plan must fit."""
    return dataclasses.replace(machine, store_slowdown=1.0)


def candidates(costs, machine, plan, stored_limit=float("inf"), limit=3):
    """The plans worth one measured step each before one is committed to: `plan`
    (solve's answer), then the plan solve gives when copies are counted at the probed
    rate for memory too (store_slowdown 1: the safety factor set aside), then the
    fastest uniform plan (every block the same choice) that fits the budget by that
    count. The model's safety factor and its time model can be wrong in either
    direction on a given machine; a measured step is not. At most `limit` plans,
    each once, `plan` first; every one is predicted, without the safety factor, to
    fit plan.budget (a measured step may still reach more: it is then not chosen)."""
    n = len(costs)
    optimistic = without_safety_factor(machine)
    found = [list(plan.choices)]
    try:
        relaxed = solve(costs, optimistic, plan.budget, stored_limit)
        found.append(list(relaxed.choices))
    except BudgetError:
        pass
    uniform = []
    for choice in _allowed(machine):
        prediction = simulate(costs, optimistic, [choice] * n)
        if _fits(prediction, plan.budget, stored_limit):
            uniform.append((prediction.time_s, CHOICES.index(choice), [choice] * n))
    if uniform:
        found.append(min(uniform)[2])
    unique = []
    for choices in found:
        if choices not in unique:
            unique.append(choices)
    return unique[:max(1, limit)]


def _infeasible_message(costs, machine, budget, stored_limit, smallest, prediction):
    def need(c):
        return max(_min_backward_work(c, machine), c.forward_work)
    worst = max(costs, key=need)
    text = f"memory budget {format_bytes(budget)} cannot be met: "
    if smallest is None:
        return text + (f"no plan stores at most {format_bytes(stored_limit)} "
                       "(the session's quota)")
    text += (f"the smallest peak any plan reaches is {format_bytes(prediction.peak_bytes)} "
             f"({_describe(smallest)}); block {worst.name} alone needs "
             f"{format_bytes(need(worst))} while it runs")
    return text


def _describe(plan):
    kinds = sorted(set(plan))
    if len(kinds) == 1:
        return f"every block {kinds[0]}"
    return ", ".join(f"{plan.count(k)} {k}" for k in kinds)


def format_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def parse_bytes(text, what=None, percent_base=0):
    """'6GiB', '4G', '512 MiB' (binary), '1.5GB' (decimal), '1000' -> bytes, and '50%' of
    percent_base: the daemon's parser (common/units.h), through the native library.
    ValueError otherwise, naming `what` when given."""
    # The native library, imported here: this module stays importable alone.
    from actstash._native import lib as _lib
    return _lib.parse_size(text, percent_base, what=what)
