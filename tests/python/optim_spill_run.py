"""One trainer of test_optim_spill.py's concurrent run: test_optim_spill's GPT (seed
SEED), its states in OffloadAdamW (parked: the daemon has a spill tier), activations
offloaded, STEPS steps at the same time as the other trainer (both build their
optimizer, then both start). Writes the parameters and the stash's counters to OUT.
test_optim_spill.py trains the same model with the same steps.

    optim_spill_run.py SEED STEPS READY_DIR OUT        (ACTSTASH_ADDRESS set)
"""
import os
import sys
import time

import torch

import actstash
from actstash.optim import OffloadAdamW
from gpt import GPT, loss_fn


def big_model(seed):
    # 3.2 M parameters: 25.6 MiB of fp32 moments, more than half the pool.
    torch.manual_seed(seed)
    return GPT(vocab=128, dim=256, heads=4, layers=4, context=32, dropout=0.0)


def train_step(model, opt, step, stash=None, micro=2):
    """One optimizer step of `micro` accumulated micro-batches, clipped; the
    activations offloaded to `stash` when given."""
    for m in range(micro):
        idx = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(
            1000 * step + m))
        if stash is None:
            loss = loss_fn(model, idx) / micro
        else:
            with stash.offload(min_bytes=0):
                loss = loss_fn(model, idx) / micro
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main():
    seed, steps, ready, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    model = big_model(seed)
    stash = actstash.connect(os.environ["ACTSTASH_ADDRESS"])
    opt = OffloadAdamW(model.parameters(), stash=stash, lr=1e-3, weight_decay=0.1)
    open(os.path.join(ready, str(seed)), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(ready)) < 2:  # the other trainer's states are in the pool too
        if time.monotonic() > deadline:
            sys.exit("the other trainer never got ready")
        time.sleep(0.01)
    for step in range(steps):
        train_step(model, opt, step, stash)
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "stats": stash.stats(), "parked": opt._parking}, out)
    del opt
    stash.close()


if __name__ == "__main__":
    main()
