#!/usr/bin/env python3
"""DistributedDataParallel on CPU (gloo), one process per rank, every rank a
session of the same actstashd; prints what each rank moved.

    ACTSTASH_ADDRESS=/path/actstash.sock python3 examples/train_ddp.py --ranks 2
    # or under torchrun / any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR,
    # MASTER_PORT: python3 examples/train_ddp.py

--mode none trains without offload (the reference); --out DIR saves each
rank's final parameters and gradients for comparison.
"""
import argparse
import datetime
import json
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from gpt import GPT, Block, loss_fn

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # torch >= 2.4 starts its TCPStore on libuv by default and fails where torch
    # was built without it (Debian's torch 2.x); the older store works everywhere.
    os.environ.setdefault("USE_LIBUV", "0")
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT(vocab=256, dim=args.dim, heads=4, layers=args.layers, context=32, dropout=0.1)
    stash = None
    if args.mode != "none" or args.optimizer == "offload-adamw":
        import actstash
        quota = args.rank_quota.get(rank, 0)
        stash = actstash.connect(args.address or None, quota=quota, name=f"rank{rank}",
                                 on_unavailable=args.on_unavailable)
    if args.mode != "none":
        actstash.wrap(model, stash, blocks=Block, mode=args.mode, min_bytes=0)
    ddp = DDP(model)
    if args.optimizer == "offload-adamw":  # Adam's states in the node's pool
        from actstash.optim import OffloadAdamW
        optimizer = OffloadAdamW(ddp.parameters(), stash=stash, lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    torch.manual_seed(1000 + rank)  # each rank its own data and dropout
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(args.accumulate):
            idx = torch.randint(0, 256, (4, 33))
            if micro < args.accumulate - 1:
                with ddp.no_sync():
                    loss_fn(ddp, idx).backward()
            else:
                loss_fn(ddp, idx).backward()
        if args.out and step == args.steps - 1:
            grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        print(json.dumps({"rank": rank, "step": step}), flush=True)
    report = {"rank": rank, "pid": os.getpid()}
    if stash is not None:
        stats = stash.stats()
        report.update(session=stash.client.session_id, bytes_offloaded=stats["bytes_offloaded"],
                      bytes_fetched=stats["bytes_fetched"], tensors_kept=stats["tensors_kept"],
                      available=stash.available,
                      optimizer_state_bytes=stats.get("optimizer_state_bytes", 0))
    if args.out:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "grads": grads}, os.path.join(args.out, f"rank{rank}.pt"))
    print(json.dumps({"report": report}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=0, help="launch this many ranks")
    parser.add_argument("--address", default=os.environ.get("ACTSTASH_ADDRESS", ""))
    parser.add_argument("--mode", default="offload",
                        choices=["none", "offload", "checkpoint", "checkpoint+offload"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=30.0, help="collective timeout (s)")
    parser.add_argument("--on-unavailable", default="raise", choices=["raise", "keep"])
    parser.add_argument("--rank-quota", default="", help="RANK:BYTES,... per-rank quotas")
    parser.add_argument("--out", default="", help="save each rank's params and grads here")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "offload-adamw"],
                        help="torch's AdamW, or actstash.optim.OffloadAdamW (states in the pool)")
    args = parser.parse_args()
    args.rank_quota = {int(r): int(q) for r, q in
                       (item.split(":") for item in args.rank_quota.split(",") if item)}
    if args.ranks == 0:  # a rank (torchrun-style environment)
        worker(args)
        return 0
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(args.ranks))
    argv = [sys.executable, os.path.abspath(__file__)]
    skip = False
    for a in sys.argv[1:]:  # the ranks get every argument but --ranks
        if skip:
            skip = False
        elif a == "--ranks":
            skip = True
        elif not a.startswith("--ranks="):
            argv.append(a)
    procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True)
             for r in range(args.ranks)]
    status = 0
    for proc in procs:
        out, _ = proc.communicate()
        status = status or proc.returncode
        for line in out.splitlines():
            message = json.loads(line)
            if "report" in message:
                r = message["report"]
                print(f"rank {r['rank']} (pid {r['pid']}): " + (
                    f"offloaded {r['bytes_offloaded'] / 2**20:.1f} MiB, fetched "
                    f"{r['bytes_fetched'] / 2**20:.1f} MiB, optimizer state in the pool "
                    f"{r['optimizer_state_bytes'] / 2**20:.1f} MiB, session {r['session']}"
                    if "session" in r else "no offload"))
    return status


if __name__ == "__main__":
    sys.exit(main())
