"""One rank of test_sharded.py: FSDP2 (fully_shard), FSDP (FullyShardedDataParallel)
or a pipeline (torch.distributed.pipelining) on CPU with gloo, every
rank a session of the same actstashd, 3 AdamW steps. Writes the rank's full
parameters and the stash's counters to OUT/rank{RANK}.pt.

    sharded_run.py STRATEGY MODE WHEN OUT     (RANK, WORLD_SIZE, MASTER_ADDR,
                                               MASTER_PORT, ACTSTASH_ADDRESS set)

STRATEGY: fsdp2, fsdp, pipeline (GPipe) or zerobubble (interleaved, backward split).
MODE: none (the reference), offload, checkpoint, checkpoint+offload. WHEN: before or
after (wrap before or after sharding; pipelines wrap each stage).
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from gpt import GPT, loss_fn

DIM, LAYERS, CONTEXT, VOCAB, BATCH, MICRO = 64, 4, 32, 128, 8, 4
STEPS = 3


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=g)


def wrap(stash, model, blocks, mode):
    import actstash
    if mode != "none":
        actstash.wrap(model, stash, blocks=blocks, mode=mode, min_bytes=0)


def sharded(strategy, mode, when, rank, stash):
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, dim=DIM, heads=4, layers=LAYERS, context=CONTEXT, dropout=0.0)
    if when == "before":
        wrap(stash, model, model.blocks, mode)
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded_model = model
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from gpt import Block
        sharded_model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                             use_orig_params=True, device_id=torch.device("cpu"))
    if when == "after":
        from gpt import Block
        wrap(stash, model, Block, mode)  # fully_shard subclasses it: found by isinstance
    optimizer = torch.optim.AdamW(sharded_model.parameters(), lr=1e-2)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(sharded_model, batch(rank, step)).backward()
        optimizer.step()
    if strategy == "fsdp2":
        return [p.full_tensor().detach().clone() for p in model.parameters()]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    with FSDP.summon_full_params(sharded_model):
        return [p.detach().clone() for p in sharded_model.parameters()]


class Head(nn.Module):
    """Stage 1 of the pipeline: the last blocks, the final norm and the head."""

    def __init__(self, model, blocks):
        super().__init__()
        self.blocks, self.ln, self.head = blocks, model.ln, model.head

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Embed(nn.Module):
    """Stage 0: the embeddings and the first blocks."""

    def __init__(self, model, blocks):
        super().__init__()
        self.tok, self.pos, self.blocks = model.tok, model.pos, blocks

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return x


class Middle(nn.Module):
    """An inner stage: blocks only."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def pipelined(strategy, mode, rank, stash):
    """pipeline: 2 stages (one per rank), GPipe. zerobubble: 4 stages (rank r holds
    r and r + 2), ScheduleInterleavedZeroBubble, whose backward runs per stage in
    two passes, for the input's gradient first and the weights' later."""
    from torch.distributed import pipelining
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, dim=DIM, heads=4, layers=LAYERS, context=CONTEXT, dropout=0.0)
    count = 2 if strategy == "pipeline" else 4
    per = LAYERS // count
    parts, stages = [], []
    for index in range(rank, count, 2):
        blocks = model.blocks[index * per:(index + 1) * per]
        part = (Embed(model, blocks) if index == 0 else
                Head(model, blocks) if index == count - 1 else Middle(blocks))
        wrap(stash, part, part.blocks, mode)
        parts.append(part)
        stages.append(pipelining.PipelineStage(part, index, count, torch.device("cpu")))

    def loss(logits, target):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           target.reshape(-1))

    if strategy == "pipeline":
        schedule = pipelining.ScheduleGPipe(stages[0], n_microbatches=MICRO, loss_fn=loss)
    else:
        schedule = pipelining.ScheduleInterleavedZeroBubble(stages, n_microbatches=MICRO,
                                                            loss_fn=loss)
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        idx = batch(0, step)  # one batch for the whole pipeline
        # Contiguous: torch 2.6's pipelining checks a micro-batch's strides against
        # the shape it inferred.
        if rank == 0:
            schedule.step(idx[:, :-1].contiguous())
        else:
            schedule.step(target=idx[:, 1:].contiguous())
    return [p.detach().clone() for p in params]


def main():
    strategy, mode, when, out = sys.argv[1:5]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    os.environ.setdefault("USE_LIBUV", "0")  # Debian's torch has no libuv TCPStore
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    stash = None
    if mode != "none":
        import actstash
        stash = actstash.connect(os.environ["ACTSTASH_ADDRESS"])
    if strategy in ("pipeline", "zerobubble"):
        params = pipelined(strategy, mode, rank, stash)
    else:
        params = sharded(strategy, mode, when, rank, stash)
    stats = {}
    if stash is not None:
        stash.synchronize()
        stats = {k: v for k, v in stash.stats().items() if isinstance(v, int)}
    torch.save({"params": params, "stats": stats}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
