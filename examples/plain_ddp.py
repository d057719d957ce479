"""A plain PyTorch DDP training loop with ETT: accounting, checkpoints and exact resume.

    torchrun --nproc-per-node 2 examples/plain_ddp.py --checkpoint-dir /tmp/ddp --interval 5
    ett submit examples/jobs/plain_ddp.toml             # the same script as an ETT job

Every batch is drawn from a generator seeded by (step, rank), so the data needs no state of its
own; the model has dropout, so resume must restore each rank's RNG to be exact.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ett


def batch(step: int, rank: int, batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    inputs_BD = torch.randn(batch_size, 32, generator=generator)
    targets_B1 = inputs_BD[:, :4].sum(dim=1, keepdim=True).sin()
    return inputs_BD, targets_B1


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    with ett.init(checkpoint_dir=args.checkpoint_dir, interval_steps=args.interval) as run:
        with run.initializing():
            torch.manual_seed(0)  # the same initial weights on every rank
            layers = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
            model = DistributedDataParallel(layers)
            # DDP regroups its gradient buckets after its first backward. A restart's first step
            # would still sum in the first grouping, which with three or more ranks rounds
            # differently: one backward of nothing (zero gradients, no random numbers drawn)
            # settles the grouping first, so every step sums alike, resumed or not.
            with torch.random.fork_rng():
                model(torch.zeros(1, 32)).sum().mul(0.0).backward()
            model.zero_grad(set_to_none=True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            torch.manual_seed(1 + rank)  # each rank its own dropout masks

        def training_state() -> dict:
            # As DCP takes it: state dicts, taken anew for each save (`optimizer.state_dict()` is a
            # new dict each call, its moments there once the first step made them).
            return {"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": ett.RNGState(rank)}

        state = training_state()
        start = run.restore(state)  # the model's tensors in place; the optimizer's moments added to its dict
        if start:
            optimizer.load_state_dict(state["optim"])
        run.total_steps = args.steps  # the service weighs a straggler's cost over the steps left
        for step in range(start + 1, args.steps + 1):
            with run.step(step, tokens=16 * dist.get_world_size()) as s:
                inputs_BD, targets_B1 = batch(step, rank)
                loss = F.mse_loss(model(inputs_BD), targets_B1)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                time.sleep(args.step_seconds)
                s.loss = loss.item()
            run.checkpoint(step, training_state(), force=step == args.steps)

    if args.out and rank == 0:
        torch.save(model.module.state_dict(), args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", default=None, help="outside ETT: where to save and resume from")
    parser.add_argument("--interval", type=int, default=5, help="outside ETT: save every N steps")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step, to stand for real compute")
    parser.add_argument("--out", default=None, help="rank 0 writes the final parameters here (torch.save)")
    args = parser.parse_args()

    if "WORLD_SIZE" in os.environ:  # torchrun (or an ETT agent, through torchrun)
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    train(args)
    # The DDP model is gone (train() returned) while the group is still registered: freed after
    # destroy_process_group, its reducer would drop the group's last reference, and the group's
    # destructor joins gloo's threads holding the GIL (a rank of examples/hf_trainer.py hung so).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
