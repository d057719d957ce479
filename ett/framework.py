"""What an integration with a framework that owns the training loop (Lightning, the Hugging Face
Trainer) calls on its Run (docs/library.md, "Frameworks that own the loop"): the pairs of marks a
callback makes where a script would use a `with` block, and the choice and the commit of the
checkpoint folders the framework writes itself. The integrations use these public names only.

    run.begin_init()                       # the framework is being set up ...
    run.reclaim_sigterm()                  # ETT's SIGTERM handler back, over the framework's
    run.end_init()                         # ... and trains from here
    found = run.resume_folder("step_{step}")  # the newest of its checkpoints that verifies, or None
    if found: <the framework loads found.folder>; run.restored(found.step)
    run.begin_step(n); ...; run.end_step(loss)
    with run.saving(n, folder):            # ckpt_start; <the framework saves>; ckpt_staged,
        <the framework saves into folder>  # then commit_folder: every rank's part written, keep applied
"""

import logging
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from ett.errors import UsageError
from ett.checkpoints.folder_patterns import folder_pattern, pattern_of_folder
from ett.checkpoints.folders import first_verified, folder_manifest, prune, resume_candidates, step_of, write_marker

logger = logging.getLogger(__name__)


class ResumePoint(NamedTuple):
    """A framework's checkpoint to resume from (run.resume_folder): its folder and its step."""

    folder: str
    step: int


class Saving:
    """One save of a framework's own (`with run.saving(step, folder) as save:`): call `save.staged()`
    where the loop may go on while the framework writes in the background; without it the whole
    block blocked the loop."""

    def __init__(self, run: "FrameworkHooks", step: int):
        self.run, self.step, self.is_staged = run, step, False

    def staged(self) -> None:
        if not self.is_staged:
            self.is_staged = True
            self.run._events.emit("ckpt_staged", step=self.step)


class FrameworkHooks:
    """Mixed into Run (ett/run.py): the names below are Run's."""

    def saves_its_own_checkpoints(self, framework: str) -> str | None:
        """Says, once, what ETT's checkpoint tiers give a framework that saves its own checkpoints,
        when the job asked for per-step snapshots: none. They are taken through `run.checkpoint`
        (the state as ETT sees it); the framework's checkpoints are the persistent tier only.
        Returns the message (None: the job asked for none)."""
        if not (self._config.snapshots and self._config.local_dir):
            return None
        message = (f"checkpoint.snapshots: {framework} saves and loads its own checkpoints, so ETT's per-step "
                   "snapshots (and their copies on a peer node) are not taken for it; a failure, a lost node "
                   f"included, resumes from its newest committed checkpoint (every {self.interval_steps} steps)")
        logger.warning(message)
        return message

    def begin_init(self) -> bool:
        """Marks the start-up's start, once per run; False when it was marked already (the script
        marked it with `run.initializing()`, or an integration did): then leave its end alone."""
        if self._init_marked:
            return False
        self._init_marked = True
        self._events.emit("init_start", pid=self._pid)
        return True

    def end_init(self) -> None:
        """Marks the start-up's end: training starts."""
        self._events.emit("init_end")

    def reclaim_sigterm(self) -> None:
        """Puts ETT's SIGTERM handler back, for a framework that put its own in place after
        `ett.init()` (Lightning does, as `fit` starts): a SIGTERM then asks for a stop after the
        step and a final save, on every rank alike (`should_stop`). Nothing when the run does not
        handle SIGTERM."""
        if self._handles_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def begin_step(self, step: int, tokens: int | None = None) -> None:
        """Starts step `step`, as entering `with run.step(step)` does; `end_step` ends it."""
        if self._open_step is not None:
            raise UsageError(f"run.begin_step({step}): step {self._open_step.step} has not ended (run.end_step)")
        self._open_step = self.step(step, tokens).__enter__()

    def end_step(self, loss: Any = None) -> None:
        """Ends the step `begin_step` started, with its loss (a float or a tensor) when known."""
        if self._open_step is None:
            raise UsageError("run.end_step(): no step was begun (run.begin_step)")
        step, self._open_step = self._open_step, None
        step.loss = loss if loss is not None else step.loss
        step.__exit__(None, None, None)

    def resume_folder(self, pattern: str | re.Pattern, root: str | None = None) -> ResumePoint | None:
        """The newest checkpoint folder of the framework's own under `root` (default: the job's
        checkpoint folder) that verifies, starting from the one the service named, with its step;
        None: none (train from the start). `pattern` names the folders: a format ("step_{step}",
        "ckpt-{step:06d}") or a regular expression (r"step_(\\d+)", a string or compiled) whose
        group `step`, else its first, is the step. Each folder skipped is logged with its reason.
        Marks the restore's start for the report."""
        pattern = folder_pattern(pattern)
        root = root or self.checkpoint_dir
        named = self.resume_from if self.resume_from and pattern.match(Path(self.resume_from).name) else None
        folder = first_verified(resume_candidates(root, named, pattern))
        if folder is None:
            return None
        self._events.emit("restore_start")
        return ResumePoint(str(folder), step_of(folder, pattern))

    @contextmanager
    def saving(self, step: int, folder: str | Path | None = None, pattern: str | re.Pattern | None = None,
               apply_keep: bool = True) -> Iterator[Saving]:
        """Around one save the framework makes itself: `ckpt_start` as the block starts, `ckpt_staged`
        as it ends (or at `save.staged()`: the loop went on from there), and, given the `folder` the
        block writes, its commit once every rank's part is written (`commit_folder`, `run.keep` applied).
        Every rank enters it. A block that raises books `ckpt_failed`; its folder is not committed."""
        self._events.emit("ckpt_start", step=step)
        save = Saving(self, step)
        try:
            yield save
        except BaseException as error:
            self._events.emit("ckpt_failed", step=step, error=repr(error))
            raise
        save.staged()
        if folder is not None:
            self.commit_folder(folder, step, pattern, apply_keep)

    def commit_folder(self, folder: str | Path, step: int, pattern: str | re.Pattern | None = None,
                      apply_keep: bool = True) -> int | None:
        """Commits a checkpoint folder the framework wrote (docs/library.md): every rank calls it
        once its own part is written; when all have, rank 0 writes the marker and its manifest of
        every file (ett/checkpoints/folders.py), reports the commit, then keeps the newest
        `run.keep` committed folders beside it: those named by `pattern` (default: the folder's
        name with its step's digits as any step), older ones removed. `apply_keep=False`: none removed
        (a framework that rotates its own). The folder's bytes on rank 0, else None."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's part is on disk
        folder = Path(folder)
        if self.rank != 0:
            return None
        if not folder.is_dir():
            raise UsageError(f"run.commit_folder: {folder} is no folder: nothing was saved there (a framework that "
                             "names its own folders, such as Accelerate's automatic_checkpoint_naming, wrote elsewhere?)")
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        nbytes = write_marker(folder, step, world_size, folder_manifest(folder))
        self._events.emit("ckpt_committed", step=step, path=str(folder), bytes=nbytes)
        if apply_keep:
            self._keep_newest(folder, step, pattern)
        return nbytes

    def _keep_newest(self, folder: Path, step: int, pattern: str | re.Pattern | None) -> None:
        siblings = folder_pattern(pattern) if pattern is not None else pattern_of_folder(folder, step)
        if siblings is None or not siblings.match(folder.name):
            logger.warning("checkpoint.keep: %s was committed but older ones are not removed: its name does not "
                           "spell its step %d; give run.commit_folder the folders' pattern", folder, step)
            return
        prune(folder.parent, max(1, self.keep), siblings)
