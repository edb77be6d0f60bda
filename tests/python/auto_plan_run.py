"""Child process of test_auto_plan.py: trains a model with wrap(policy="auto")
under several budgets next to plain autograd and prints what it saw as JSON.

It runs in its own process because the peak memory it checks is RssAnon, with
glibc told (MALLOC_MMAP_THRESHOLD_, set by the parent) to give large blocks back
to the system when they are freed, so that RssAnon follows what the trainer
holds. The peak of a step is measured here, independently of the planner: a
sampling thread, from the first block's forward (a forward pre-hook) to the end
of backward, above RssAnon at that first hook (actstash_testing.memory, as
bench/auto_plan_bench.py measures it).

    auto_plan_run.py SOCKET MODEL STEPS [COPY_DELAY_US]
    auto_plan_run.py SOCKET quota STEPS
"""
import copy
import json
import sys

import torch
from torch import nn

import actstash
from actstash._plan._planner import BudgetError
from actstash_testing.memory import PeakMeter
from actstash_testing.training import bitwise_equal, cloned_grads

torch.set_num_threads(1)
# A run ends once this many steps ran a plan that had settled before they began (or
# after the steps asked for): test_auto_plan.py checks those steps' peaks.
STEADY = 2


def gpt():
    from gpt import GPT, loss_fn
    torch.manual_seed(0)
    model = GPT(vocab=256, dim=128, heads=4, layers=4, context=128)
    batch = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(1))
    return model, model.blocks[0], lambda m: loss_fn(m, batch)


def encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, dropout=0.1,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4)
    x = torch.randn(8, 128, 128, generator=torch.Generator().manual_seed(1))
    target = torch.randn(8, 128, 128, generator=torch.Generator().manual_seed(2))
    return model, model.layers[0], lambda m: nn.functional.mse_loss(m(x), target)


def step(model, loss, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss(model).backward()
    return cloned_grads(model)


def run(stash, model, first, loss, reference, budget, steps, seed0, steady=None):
    """Steps under wrap(policy="auto", budget): per step the plan, the bitwise check,
    the stash's counters and the peak. At most `steps`; with `steady`, it stops once that
    many steps ran a plan that had settled before they began (checked, staying)."""
    meter = PeakMeter(first, only_with_grad=True)
    actstash.wrap(model, stash, policy="auto", budget=budget)
    out = []
    settled_steps = 0
    try:
        for k in range(steps):
            if steady is not None and settled_steps >= steady:
                break
            report = stash.plan()
            settled = report is not None and report.settled
            before = stash.stats()
            try:
                grads = step(model, loss, seed0 + k)
            except BudgetError as error:
                meter.cancel()
                out.append({"error": str(error)})
                break
            peak = meter.stop()
            stash.synchronize()
            after = stash.stats()
            report = stash.plan()
            out.append({
                "bitwise": bitwise_equal(grads, reference[k]),
                "peak": peak,
                "offloaded": after["bytes_offloaded"] - before["bytes_offloaded"],
                "fetched": after["bytes_fetched"] - before["bytes_fetched"],
                "live": after["live_bytes"],
                "choices": report.choices,
                "predicted_peak": report.predicted_peak,
                "chosen_by_measurement": report.chosen_by_measurement,
                "chosen_peak_at_probed_rate": next(
                    (c["predicted_peak_at_probed_rate"] for c in report.candidates
                     if c["chosen"]), None),
                "smallest_peak": report.smallest_peak,
                "kept_peak": report.kept_peak,
                "limited_by_quota": report.limited_by_quota,
                "predicted_stored": report.predicted_stored,
                "block_offload": max((c.offload_bytes for c in report.costs or ()), default=0),
                "table": str(report),
                "settled_before": settled,
            })
            settled_steps = settled_steps + 1 if settled else 0
    finally:
        actstash.unwrap(model)
    return out


def quota_run(socket, steps):
    """The GPT at a budget where most blocks would be offloaded, in a session without
    a quota and in one whose quota holds two blocks' offload."""
    model, first, loss = gpt()
    reference = [step(copy.deepcopy(model), loss, 100 + k) for k in range(steps)]
    out = {}
    free = actstash.connect(socket)
    fits = run(free, model, first, loss, reference, 1 << 40, 2, 100)[-1]
    free.close()
    budget = fits["smallest_peak"] + (fits["kept_peak"] - fits["smallest_peak"]) // 4
    for label, quota in (("unlimited", 0), ("limited", 2 * fits["block_offload"] + (4 << 20))):
        s = actstash.connect(socket, quota=quota)
        assert s.client.quota == quota or not quota
        steps_seen = run(s, model, first, loss, reference, budget, steps, 100)
        out[label] = dict(steps_seen[-1],
                          offloaded_per_step=[r.get("offloaded", 0) for r in steps_seen])
        s.close()
        out["quota"] = quota
    print(json.dumps(out))


def main():
    if sys.argv[2] == "quota":
        return quota_run(sys.argv[1], int(sys.argv[3]))
    socket, name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    delay = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    model, first, loss = {"gpt": gpt, "encoder": encoder}[name]()
    plain = copy.deepcopy(model)
    reference = [step(plain, loss, 100 + k) for k in range(steps)]
    stash = actstash.connect(socket, copy_delay_us=delay, seed=3)
    # Everything fits: the planner says what peaks are reachable.
    results = {"fits": run(stash, model, first, loss, reference, 1 << 40, steps, 100, STEADY)}
    last = results["fits"][-1]
    high = last["kept_peak"]
    # Each profile predicts the smallest peak anew from its own measurements; the
    # budgets start from the largest of three profiles' predictions. (Whether the last
    # block's store is still in flight at the end of the tail used to turn on the
    # probed throughput, and the encoder's prediction came out at 11 or 22 MiB; the
    # planner now counts copies as slower than probed, see _planner.simulate.)
    low = max([last["smallest_peak"]] +
              [run(stash, model, first, loss, reference, 1 << 40, 2, 100)[-1]["smallest_peak"]
               for _ in range(2)])
    budgets = {"middle": low + (high - low) // 2, "quarter": low + (high - low) // 4,
               "smallest": int(low * 1.35), "impossible": low // 3}
    for label, budget in budgets.items():
        results[label] = run(stash, model, first, loss, reference, budget, steps, 100, STEADY)
    stash.close()
    print(json.dumps({"budgets": budgets, "smallest": low, "kept": high, "runs": results}))


if __name__ == "__main__":
    main()
