"""Byte-level language-modelling data from a corpus every machine already has: the Python
standard library's source files (or any folder of .py files).

The sorted files form one byte stream cut into windows of seq_len + 1 bytes. Each epoch visits
the windows in a seeded permutation, a global batch of full world size x batch_size windows a
step, split over the ranks and their micro batches by global index (ett/elastic.py): at full
size rank r takes every world_size-th window, at fewer ranks each rank takes the micro batches of
several full-size ranks, so a step trains on the same windows at any size. Every rank consumes
one step's batches at a time, so the position (epoch, batch) is one pair, the same at any size,
that the checkpoint stores; the loader reads only the bytes of the windows it serves.
"""

import bisect
import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ett.elastic import ElasticPlan

logger = logging.getLogger(__name__)


@dataclass
class DataConfig:
    root: str = ""  # folder searched for .py files; empty: the Python standard library
    seed: int = 0  # window order of each epoch

    def validate(self) -> None:
        if self.root and not Path(self.root).is_dir():
            raise ValueError(f"data.root is not a folder: {self.root!r}")


class SourceCorpus:
    """The sorted .py files under a folder, seen as one byte stream."""

    def __init__(self, root: str = ""):
        self.root = Path(root or sysconfig.get_paths()["stdlib"])
        # Plain strings, not Path objects: every rank scans about 1,800 files at every start.
        top = str(self.root)
        self.paths: list[str] = []
        names: list[str] = []  # relative to the root, for the fingerprint
        for folder, subfolders, files in os.walk(top):
            # Installed packages differ between machines; the standard library itself does not.
            subfolders[:] = sorted(d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__"))
            relative = os.path.relpath(folder, top)
            for name in sorted(f for f in files if f.endswith(".py")):
                self.paths.append(os.path.join(folder, name))
                names.append(name if relative == "." else f"{relative}/{name}")
        sizes = [os.stat(path).st_size for path in self.paths]
        self.starts = [0]
        for size in sizes:
            self.starts.append(self.starts[-1] + size)
        if self.num_bytes == 0:
            raise ValueError(f"data.root: no .py files under {self.root}")
        listing = "\n".join(f"{name}:{size}" for name, size in zip(names, sizes))
        self.fingerprint = hashlib.sha256(listing.encode()).hexdigest()[:16]

    @property
    def num_bytes(self) -> int:
        return self.starts[-1]

    def read(self, offset: int, length: int) -> bytes:
        chunks = []
        i = bisect.bisect_right(self.starts, offset) - 1
        while length > 0:
            with open(self.paths[i], "rb") as f:
                f.seek(offset - self.starts[i])
                chunk = f.read(min(length, self.starts[i + 1] - offset))
            if not chunk:
                raise OSError(f"{self.paths[i]} shrank while training; the corpus must not change")
            chunks.append(chunk)
            offset, length, i = offset + len(chunk), length - len(chunk), i + 1
        return b"".join(chunks)


class ByteBatchLoader:
    """Stateful (DCP) loader of (inputs_BT, targets_BT) batches for one data-parallel rank;
    `full_world_size`: the data-parallel size whose global batch it keeps (None: world_size)."""

    def __init__(self, corpus: SourceCorpus, batch_size: int, seq_len: int, rank: int, world_size: int, seed: int,
                 full_world_size: int | None = None):
        self.corpus, self.batch_size, self.seq_len, self.seed = corpus, batch_size, seq_len, seed
        full = full_world_size or world_size
        self.plan = ElasticPlan.declare(full * batch_size, batch_size, world_size, full, rank)
        self.num_windows = (corpus.num_bytes - 1) // seq_len
        self.batches_per_epoch = self.num_windows // self.plan.global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(f"train.batch_size: the corpus ({corpus.num_bytes} bytes) is too small for one batch")
        self.epoch, self.batch = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        # int32 draws the same permutation as int64 (the default) in a third of the time: a
        # million windows took each rank 73 ms of a restart's CPU under load.
        dtype = torch.int32 if self.num_windows < 2**31 else torch.int64
        return torch.randperm(self.num_windows, generator=generator, dtype=dtype)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro batches of the next step (plan.accumulation_steps of them)."""
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
            self._order = self._epoch_order()
        # The step's windows are positions batch * global_batch ... of the epoch's order.
        step_positions = self.plan.sample_indices(self.batch + 1)
        micro_batches = [self._read(self._order[positions].tolist()) for positions in step_positions]
        self.batch += 1
        return micro_batches

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's batch, at full size (no accumulation)."""
        [batch] = self.next_step()
        return batch

    def _read(self, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        data = b"".join(self.corpus.read(w * T, T + 1) for w in windows)
        tokens_BT1 = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(windows), T + 1).long()
        return tokens_BT1[:, :-1], tokens_BT1[:, 1:]

    def state_dict(self) -> dict:
        # The same on every rank (all consume one batch per step): DCP stores it once.
        return {"epoch": self.epoch, "batch": self.batch, "corpus": self.corpus.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state["corpus"] != self.corpus.fingerprint:
            logger.warning(
                "the corpus under %s differs from the one the checkpoint was trained on "
                "(another Python version?); the data order will not match the original run", self.corpus.root
            )
        # The order held is always this epoch's (a permutation of every window): drawn again only for another.
        if state["epoch"] != self.epoch:
            self.epoch = state["epoch"]
            self._order = self._epoch_order()
        self.batch = state["batch"]
