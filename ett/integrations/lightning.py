"""PyTorch Lightning under ETT (docs/library.md, "PyTorch Lightning"): `ETTCallback` records
start-up, steps, saves and restores, has Lightning save at the job's interval and on SIGTERM (then
stop), and commits each checkpoint once every rank has written it; `resume_checkpoint` gives
`trainer.fit(ckpt_path=...)` the newest one that verifies; `ResumableDataLoader` makes a resume in
the middle of an epoch exact.

    with ett.init() as run:
        trainer = L.Trainer(max_steps=400, enable_checkpointing=False, callbacks=[ETTCallback(run)])
        data = ResumableDataLoader(dataset, batch_size=8, shuffle=True, seed=0)
        trainer.fit(model, data, ckpt_path=resume_checkpoint(run))

Each checkpoint is `lightning-<step>/model.ckpt` in the job's folder: Lightning's own file, in a
folder of ours so that it can be committed (marker and manifest, ett/checkpoints/folders.py) and a torn or
corrupt one is never resumed from. Lightning's checkpoint has no RNG state, and its rank 0 writes
it alone: the callback adds every rank's RNG states and puts each back where the data iterator of
the resumed run is already made, just before the next batch; with ResumableDataLoader the batches
go on where they stopped, so the resumed run trains exactly as the uninterrupted one would.
"""

import logging
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ett.errors import UsageError
from ett.run import Run

logger = logging.getLogger("ett")
CHECKPOINT_FOLDER = re.compile(r"^lightning-(\d{8})$")
CHECKPOINT_FILE = "model.ckpt"


def checkpoint_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"lightning-{step:08d}"


def resume_checkpoint(run: Run, root: str | None = None) -> str | None:
    """The checkpoint file of the newest `lightning-<step>` folder under the job's folder (or
    `root`) that verifies, starting from the one the service named; None: train from the start."""
    found = run.resume_folder(CHECKPOINT_FOLDER, root)
    return str(Path(found.folder) / CHECKPOINT_FILE) if found else None


def _rng_states() -> dict[str, Any]:
    """This rank's generators, as tensors and plain values: Lightning loads checkpoints with
    `weights_only`, which takes no numpy array."""
    name, keys, position, has_gauss, gauss = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": [name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss]}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class ETTCallback(L.Callback):
    """Reports a Lightning run to ETT and saves its checkpoints at the job's interval (leave
    Lightning's own ModelCheckpoint off: `enable_checkpointing=False`). `tokens_per_step`: the
    tokens of one optimizer step across all ranks, when known (the report's throughput)."""

    def __init__(self, run: Run, tokens_per_step: int | None = None, root: str | None = None):
        self.run, self.tokens_per_step = run, tokens_per_step
        self.root = root or run.checkpoint_dir  # where checkpoints go: the job's folder
        self._rng_to_load: list[dict[str, Any]] | None = None
        self._marks_init = run.begin_init()  # start-up: from here (the Trainer is built next) to training
        run.saves_its_own_checkpoints("Lightning")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's own SIGTERM handler (in place from `fit` on) broadcasts from inside the
        # signal handler of the rank that got it, a collective its peers never join: the ranks
        # hang. ETT's stops every rank after the same step, saved (should_stop, below).
        self.run.reclaim_sigterm()
        if self._marks_init:
            self.run.end_init()
        if trainer.global_step > 0:  # Lightning loaded the checkpoint resume_checkpoint() chose
            self.run.restored(trainer.global_step)
            if self._rng_to_load is not None:
                _set_rng_states(self._rng_to_load[trainer.global_rank])
        self._rng_to_load = None
        steps = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self.run.total_steps = int(steps) if steps != float("inf") else None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        self.run.begin_step(trainer.global_step + 1, tokens=self.tokens_per_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.run.end_step(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        step = trainer.global_step
        stop = self.run.should_stop()  # SIGTERM on any rank (Slurm's limit, a preemption): save, then stop
        if self.root and (stop or self.run.checkpoint_due(step)):
            self.save(trainer, step)
        if stop:
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        if self.root and step > 0 and not checkpoint_folder(self.root, step).is_dir():
            self.save(trainer, step)  # the end of training: its last step is kept

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.run.progress()  # validation is work outside steps: not a hang

    def save(self, trainer: L.Trainer, step: int) -> None:
        """Lightning writes `lightning-<step>/model.ckpt` (rank 0; every rank calls this), then the
        folder is committed and the oldest beyond the job's `keep` are removed."""
        folder = checkpoint_folder(self.root, step)
        with self.run.saving(step, folder, CHECKPOINT_FOLDER):  # committed and pruned once every rank is here
            trainer.save_checkpoint(folder / CHECKPOINT_FILE, weights_only=False)  # synchronous: the loop waits

    def state_dict(self) -> dict[str, Any]:
        """Every rank's RNG states, gathered into the checkpoint rank 0 writes (Lightning calls this
        on every rank while it builds the checkpoint)."""
        states = [_rng_states()]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, _rng_states())
        return {"rng": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get("rng") or []
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if len(states) != world_size:
            logger.warning("the checkpoint holds the RNG states of %d ranks, this run has %d: not restored",
                           len(states), world_size)
            return
        self._rng_to_load = states  # put back in on_train_start: once the data iterator is made


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning resumes exactly in the middle of an epoch. Each rank gets its
    share of the epoch in an order fixed by (`seed`, epoch) (a DistributedSampler over the world
    torchrun gives), and its state, which Lightning keeps in every checkpoint, is how many batches
    of which epoch it has served; a resumed run passes over that many indices, without loading
    them, and goes on with the next batch. Not with `persistent_workers` (their index order is
    fixed when they start)."""

    def __init__(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False, **kwargs: Any):
        if kwargs.get("persistent_workers") or "sampler" in kwargs or "batch_sampler" in kwargs:
            raise UsageError("ResumableDataLoader: it makes its own sampler; persistent_workers is not supported")
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)  # fmt: skip
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
        self._served, self._epoch = 0, 0
        self._resume: dict[str, int] | None = None

    @property
    def _index_sampler(self) -> "_ResumingIndices":
        return _ResumingIndices(self, super()._index_sampler)

    def __iter__(self) -> Iterator:
        return _Counting(self, super().__iter__())

    def _begin_pass(self) -> int:
        """The batches to pass over as this epoch's iteration starts (after Lightning set the epoch)."""
        epoch, resume, self._resume = self.sampler.epoch, self._resume, None
        skip = resume["served"] if resume and resume["epoch"] == epoch and resume["served"] < len(self) else 0
        self._epoch, self._served = epoch, skip
        return skip

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "served": self._served}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume = {"epoch": int(state_dict["epoch"]), "served": int(state_dict["served"])}
        self.sampler.set_epoch(self._resume["epoch"])  # before the iterator is made: workers take indices at once


class _ResumingIndices:
    """The loader's batches of indices, less those a resumed epoch served before."""

    def __init__(self, loader: ResumableDataLoader, indices: Any):
        self.loader, self.indices = loader, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator:
        skip = self.loader._begin_pass()
        batches = iter(self.indices)
        for _ in range(skip):
            next(batches, None)
        yield from batches


class _Counting:
    """The loader's iterator, counting the batches it serves (its state)."""

    def __init__(self, loader: ResumableDataLoader, iterator: Iterator):
        self.loader, self.iterator = loader, iterator

    def __iter__(self) -> "_Counting":
        return self

    def __next__(self) -> Any:
        batch = next(self.iterator)
        self.loader._served += 1
        return batch

    def __len__(self) -> int:
        return len(self.iterator)
