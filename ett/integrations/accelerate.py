"""Hugging Face Accelerate under ETT (docs/library.md, "Hugging Face Accelerate"): a loop of the
script's own, with Accelerate's `save_state` and `load_state` as its checkpoints.

    with ett.init() as run:
        model, optimizer, loader, scheduler = accelerator.prepare(...)
        start = resume(run, accelerator)          # 0, or the step of the checkpoint loaded
        for step in range(start + 1, steps + 1):
            with run.step(step) as s:
                ...                                 # fetch the batch in here: a slow loader is the step's
            save(run, accelerator, step)            # at the job's interval, and on SIGTERM (then stop)

Each checkpoint is `accelerate-<step>/` in the run's folder (the job's, else the one the script
gave `ett.init`), Accelerate's own files (model, optimizer, scheduler, each rank's RNG states), in a
folder of ours so that it is committed once every rank wrote its part (marker and manifest,
ett/checkpoints/folders.py), pruned to the job's `keep`, and never resumed from torn or corrupt.
Accelerate does not save where the loader stood in its epoch: the script skips the batches the
step says were done (`accelerator.skip_first_batches`, with a seedable sampler: examples/accelerate_loop.py).
"""

import logging
import re
from pathlib import Path

from accelerate import Accelerator

from ett.errors import UsageError
from ett.run import Run, Stopped

logger = logging.getLogger("ett")
CHECKPOINT_FOLDER = re.compile(r"^accelerate-(\d{8})$")


def checkpoint_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"accelerate-{step:08d}"


def resume(run: Run, accelerator: Accelerator) -> int:
    """Loads, with `accelerator.load_state`, the checkpoint the service named or else the newest
    committed one in the run's folder that verifies (each one skipped is logged with its reason),
    and returns its step; 0 when there is none (or no folder), the state left as it is. Every rank
    calls it, after `accelerator.prepare`."""
    found = run.resume_folder(CHECKPOINT_FOLDER) if run.checkpoint_dir else None
    if found is None:
        return 0
    accelerator.load_state(found.folder)
    run.restored(found.step)
    return found.step


def save(run: Run, accelerator: Accelerator, step: int, force: bool = False) -> bool:
    """Every rank, after every step: saves with `accelerator.save_state` into the run's folder when
    the job's interval asks for it, when `force`d (the last step), or when the job is told to stop
    (SIGTERM on any rank: `run.should_stop()`); the folder is committed once every rank wrote its
    part and the newest `run.keep` are kept. True when it saved. After the save of a stop it raises
    `ett.Stopped`: the script exits with `ett.EXIT_STOPPED`, and the restart goes on from this step."""
    if getattr(accelerator.project_configuration, "automatic_checkpoint_naming", False):
        # Accelerate then writes under its project_dir/checkpoints, not where it is told: nothing
        # would be found to resume from.
        raise UsageError("ett.integrations.accelerate.save: the Accelerator's ProjectConfiguration has "
                         "automatic_checkpoint_naming=True; set it False: ETT names the folders (accelerate-<step>)")
    stop = run.should_stop()  # one small all-reduce: every rank stops after the same step
    saved = False
    if run.checkpoint_dir and (force or stop or run.checkpoint_due(step)):
        folder = checkpoint_folder(run.checkpoint_dir, step)
        with run.saving(step, folder, CHECKPOINT_FOLDER):  # synchronous: the loop waits for the files
            accelerator.save_state(str(folder))
        saved = True
    if stop:
        logger.warning("SIGTERM: stopped after step %d%s", step, " and its checkpoint" if saved else "")
        raise Stopped()
    return saved
