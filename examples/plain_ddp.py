"""A plain PyTorch DDP training loop with ETT: accounting, checkpoints, exact resume, and elastic:
as an elastic job it goes on at fewer ranks with the same training (docs/library.md, "Elastic jobs").

    torchrun --nproc-per-node 2 examples/plain_ddp.py --checkpoint-dir /tmp/ddp --interval 5
    ett submit examples/jobs/plain_ddp.toml             # the same script as an ETT job

Each step trains on the same global batch at any size: its samples are numbered globally
(run.elastic), each drawn from a generator seeded by its number, so the data needs no state of its
own; a rank at less than full size accumulates the gradients of several micro batches. The model
has dropout, whose masks are drawn per micro batch (seeded by its first sample), not per rank: the
same at any size, and on resume.
"""

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ett


def micro_batch(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of these global numbers: sample n is the same wherever, and whenever, it is drawn."""
    inputs_BD = torch.stack([torch.randn(32, generator=torch.Generator().manual_seed(n)) for n in indices])
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

        def training_state() -> dict:
            # As DCP takes it: state dicts, taken anew for each save (`optimizer.state_dict()` is a
            # new dict each call, its moments there once the first step made them). Nothing in it
            # is per rank, so a checkpoint loads at any size.
            return {"model": model.state_dict(), "optim": optimizer.state_dict()}

        # Samples per step at any size, and per forward: this rank's share at its present size. Said
        # before restore, which then loads a checkpoint saved at another size.
        plan = run.elastic(global_batch=args.global_batch or 16 * run.full_world_size, micro_batch=16)
        state = training_state()
        start = run.restore(state)  # the model's tensors in place; the optimizer's moments added to its dict
        if start:
            optimizer.load_state_dict(state["optim"])
        run.total_steps = args.steps  # the service weighs a straggler's cost over the steps left
        for step in range(start + 1, args.steps + 1):
            with run.step(step, tokens=plan.global_batch) as s:
                optimizer.zero_grad()
                loss_sum = torch.zeros(())
                for i, indices in enumerate(plan.sample_indices(step)):
                    last = i == plan.accumulation_steps - 1  # DDP all-reduces once, after the last backward
                    with contextlib.nullcontext() if last else model.no_sync():
                        torch.manual_seed(indices[0])  # this micro batch's dropout masks, at any size
                        inputs_BD, targets_B1 = micro_batch(indices)
                        loss = F.mse_loss(model(inputs_BD), targets_B1)
                        # DDP averages over the ranks: scaled by 1/accumulation, the step's gradient
                        # is the mean over the global batch's micro batches, as at full size.
                        (loss / plan.accumulation_steps).backward()
                    # Compute that scales with this rank's share of the batch: at fewer ranks it runs
                    # more micro batches, so its step takes longer, as a real step would.
                    time.sleep(args.micro_batch_seconds)
                    loss_sum += loss.detach()
                optimizer.step()
                time.sleep(args.step_seconds)
                dist.all_reduce(loss_sum)  # the global batch's loss, the same at any size
                s.loss = loss_sum.item() / plan.micro_batches
            run.checkpoint(step, training_state(), force=step == args.steps)

    if args.out and rank == 0:
        torch.save(model.module.state_dict(), args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", default=None, help="outside ETT: where to save and resume from")
    parser.add_argument("--interval", type=int, default=5, help="outside ETT: save every N steps")
    parser.add_argument("--global-batch", type=int, default=0,
                        help="samples per step at any size (default: 16 a rank at the job's full size)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step, to stand for real compute")
    parser.add_argument("--micro-batch-seconds", type=float, default=0.0,
                        help="sleep per micro batch, to stand for compute that grows as an elastic job shrinks")
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
