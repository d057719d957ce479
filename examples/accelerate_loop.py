"""A Hugging Face Accelerate loop with ETT: accounting, checkpoints, a clean stop on SIGTERM and an
exact resume in the middle of an epoch.

    torchrun --nproc-per-node 2 examples/accelerate_loop.py --checkpoint-dir /tmp/acc --interval 10
    ett submit examples/jobs/accelerate.toml             # the same script as an ETT job

`resume` loads the newest checkpoint that verifies with `accelerator.load_state` (model, AdamW,
OneCycleLR, each rank's RNG), `save` saves with `accelerator.save_state` at the job's interval and
on SIGTERM. Where the loader stood is the step itself: the seedable sampler's order is fixed by
(seed, epoch), so the resumed run sets the epoch and skips the batches already trained
(`skip_first_batches`). The model has dropout: its masks come from the restored RNG.
"""

import argparse
import gc
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ett
from ett.integrations.accelerate import resume, save

BATCH = 4


def dataset(samples: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    inputs_ND = torch.randn(samples, 16, generator=generator)
    return TensorDataset(inputs_ND, inputs_ND[:, :4].sum(dim=1, keepdim=True).sin())


def batches_from(accelerator: Accelerator, loader: DataLoader, step: int) -> Iterator:
    """The batches after the first `step` ones, epoch after epoch: the epoch that step falls in,
    without its batches already trained, then whole epochs."""
    epoch, done = divmod(step, len(loader))
    while True:
        loader.set_epoch(epoch)  # the seedable sampler's order of this epoch
        yield from accelerator.skip_first_batches(loader, done) if done else loader
        epoch, done = epoch + 1, 0


def train(args: argparse.Namespace) -> None:
    with ett.init(checkpoint_dir=args.checkpoint_dir, interval_steps=args.interval, keep=2) as run:
        with run.initializing():
            accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                                         data_seed=0))
            set_seed(0)  # the same initial weights on every rank
            model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=args.steps)
            # A generator of its own: making an iterator draws from it, not from the RNG of the dropout masks.
            loader = DataLoader(dataset(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
            model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
            torch.manual_seed(1 + accelerator.process_index)  # each rank its own dropout masks
        run.total_steps = args.steps

        start = resume(run, accelerator)  # 0 on the first run; after a restart, the step it saved
        data = batches_from(accelerator, loader, start)
        for step in range(start + 1, args.steps + 1):
            with run.step(step, tokens=BATCH * accelerator.num_processes) as s:
                inputs, targets = next(data)  # inside the step: a slow loader is counted in it, not as idle
                loss = F.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                time.sleep(args.step_seconds)
                s.loss = loss.detach()
            save(run, accelerator, step, force=step == args.steps)  # on SIGTERM: saves, then ett.Stopped

        if accelerator.is_main_process and args.out:
            torch.save(accelerator.unwrap_model(model).state_dict(), args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", default=None, help="outside ETT: where to save and resume from")
    parser.add_argument("--interval", type=int, default=10, help="outside ETT: save every N steps")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="stands for real compute")
    parser.add_argument("--out", default=None, help="rank 0 writes the final parameters here (torch.save)")
    try:
        train(parser.parse_args())
        code = 0
    except ett.Stopped as stopped:  # SIGTERM: saved and stopped; the process ends below, after the group
        code = stopped.code
    # The DDP model is gone (train() returned, its frames with it) while the process group is still
    # registered, so freeing DDP's reducer does not drop the group's last reference: when it did,
    # the group's destructor joined gloo's threads holding the GIL while one of them needed it (the
    # rank hung for ever; as in examples/plain_ddp.py). The barrier lets every collective finish first.
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
