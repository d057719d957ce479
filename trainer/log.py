"""Trainer logging: one line format carrying the rank; rank 0 logs at the configured level,
the other ranks only warnings and errors, so N ranks do not print N copies of every line."""

import logging
import sys
from dataclasses import dataclass


@dataclass
class LogConfig:
    interval_steps: int = 10  # metrics line (loss, tokens/s, MFU, memory, expert load) every N steps
    level: str = "INFO"

    def validate(self) -> None:
        if self.interval_steps < 1:
            raise ValueError(f"log.interval_steps must be >= 1, got {self.interval_steps}")
        if self.level.upper() not in logging.getLevelNamesMapping():
            raise ValueError(f"log.level must be a logging level name (INFO, DEBUG, ...), got {self.level!r}")


def setup_logging(cfg: LogConfig, rank: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
    # The ett library's lines too (the checkpoint it resumed from, the snapshot cadence): without
    # a handler of their own only its warnings reached the log, through Python's last resort.
    for name in ("trainer", "ett"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False  # DCP's checkpoint process configures the root logger its own way
        logger.setLevel(cfg.level.upper() if rank == 0 else logging.WARNING)
    # Process-based checkpointing pickles DTensors to the checkpoint process, where torch warns
    # on every save that their mesh cannot find its groups for torch.compile, which we do not use.
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
