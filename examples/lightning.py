"""A PyTorch Lightning run with ETT: accounting, checkpoints, and an exact resume mid-epoch.

    torchrun --nproc-per-node 2 examples/lightning.py --checkpoint-dir /tmp/pl --interval 5
    ett submit examples/jobs/lightning.toml             # the same script as an ETT job

Lightning owns the loop and its checkpoints; `ETTCallback` reports the run and saves at the job's
interval, `resume_checkpoint` picks the newest checkpoint that verifies, and `ResumableDataLoader`
lets the resumed run go on with the batch after the checkpoint's (`--plain-loader`: a plain
DataLoader, which Lightning restarts at the epoch's first batch). The model has dropout, so the
resume must also put back each rank's RNG, which the callback does.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

# This file is named like the package it uses: Python puts its folder first on the path, where
# `import lightning` would find this file again.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import ett  # noqa: E402
from ett.integrations.lightning import ETTCallback, ResumableDataLoader, resume_checkpoint  # noqa: E402


class Regression(L.LightningModule):
    def __init__(self, step_seconds: float):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
        self.step_seconds = step_seconds
        self.seen: list[list[int]] = []  # the samples of each step, in order: which batches it trained

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        index_B, inputs_BD, targets_B1 = batch
        self.seen.append(index_B.tolist())
        time.sleep(self.step_seconds)  # stands for real compute
        return F.mse_loss(self.layers(inputs_BD), targets_B1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def dataset(samples: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    inputs_ND = torch.randn(samples, 32, generator=generator)
    return TensorDataset(torch.arange(samples), inputs_ND, inputs_ND[:, :4].sum(dim=1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", default=None, help="outside ETT: where to save and resume from")
    parser.add_argument("--interval", type=int, default=5, help="outside ETT: save every N steps")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--plain-loader", action="store_true", help="a plain DataLoader, for the comparison")
    parser.add_argument("--out", default=None, help="rank 0 writes the final parameters here (torch.save)")
    parser.add_argument("--seen", default=None, help="rank 0 writes the samples of each step it trained (JSON)")
    args = parser.parse_args()

    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    with ett.init(checkpoint_dir=args.checkpoint_dir, interval_steps=args.interval) as run:
        L.seed_everything(0, verbose=False)  # the same initial weights on every rank
        model = Regression(args.step_seconds)
        torch.manual_seed(1 + run.rank)  # each rank its own dropout masks
        data = dataset()
        if args.plain_loader:
            loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, world, run.rank, seed=0))
        else:
            loader = ResumableDataLoader(data, batch_size=4, shuffle=True, seed=0)
        trainer = L.Trainer(
            accelerator="cpu", devices=local, num_nodes=world // local, strategy="ddp" if world > 1 else "auto",
            max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[ETTCallback(run, tokens_per_step=4 * world)],
        )  # fmt: skip
        trainer.fit(model, loader, ckpt_path=resume_checkpoint(run))
        if run.rank == 0 and args.out:
            torch.save(model.layers.state_dict(), args.out)
        if run.rank == 0 and args.seen:
            with open(args.seen, "w") as f:
                json.dump({"first_step": trainer.global_step - len(model.seen) + 1, "samples": model.seen}, f)


if __name__ == "__main__":
    main()
