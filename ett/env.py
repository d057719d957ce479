"""The environment an ETT agent hands every rank of a job (docs/library.md, "The job's
environment"), read in one place. Outside a job none of it is set and the defaults hold."""

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ett.errors import UsageError
from ett.protocol import JobEnv


def _int(environ: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise UsageError(f"environment variable {name}: must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class JobEnvironment:
    job_id: str | None = None  # None: not inside an ETT job
    attempt: int = 0
    event_dir: str | None = None  # the agent tails the spool files here
    checkpoint_dir: str | None = None  # the job's persistent checkpoint folder
    checkpoint_local_dir: str | None = None  # this node's fast folder for the same checkpoints
    resume_from: str | None = None  # the checkpoint the service chose; None: the newest that verifies
    interval_steps: int | None = None  # save every N steps (the service resolves "auto")
    keep: int | None = None  # newest committed checkpoints kept
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    # An elastic job on fewer ranks than its full size (docs/library.md, "Elastic jobs"): that size.
    full_world_size: int = 1
    learn_imports: bool = False  # the agent asks what the script imported (ett/imports.py)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "JobEnvironment":
        world_size = _int(environ, "WORLD_SIZE", 1, 1)
        full_world_size = _int(environ, JobEnv.FULL_WORLD_SIZE, world_size, 1)
        if full_world_size < world_size:
            raise UsageError(f"environment variable {JobEnv.FULL_WORLD_SIZE}: must be >= WORLD_SIZE ({world_size}), "
                             f"got {full_world_size}")
        return cls(
            job_id=environ.get(JobEnv.JOB_ID) or None,
            attempt=_int(environ, JobEnv.ATTEMPT, 0, 0),
            event_dir=environ.get(JobEnv.EVENT_DIR) or None,
            checkpoint_dir=environ.get(JobEnv.CHECKPOINT_DIR) or None,
            checkpoint_local_dir=environ.get(JobEnv.CHECKPOINT_LOCAL_DIR) or None,
            resume_from=environ.get(JobEnv.RESUME_FROM) or None,
            interval_steps=_int(environ, JobEnv.CHECKPOINT_INTERVAL_STEPS, None, 0),
            keep=_int(environ, JobEnv.CHECKPOINT_KEEP, None, 1),
            rank=_int(environ, "RANK", 0, 0),
            local_rank=_int(environ, "LOCAL_RANK", 0, 0),
            world_size=world_size,
            full_world_size=full_world_size,
            learn_imports=environ.get(JobEnv.LEARN_IMPORTS) == "1",
        )  # fmt: skip
