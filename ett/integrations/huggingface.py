"""The Hugging Face Trainer under ETT: `ETTCallback` records start-up, steps and saves, and marks
each `checkpoint-N` folder the Trainer writes as committed; `resume_checkpoint` gives
`trainer.train(resume_from_checkpoint=...)` the newest one that verifies.

    with ett.init() as run:
        args = TrainingArguments(output_dir=run.checkpoint_dir or "out", save_strategy="no", ...)
        trainer = Trainer(model, args, train_dataset=data, callbacks=[ETTCallback(run)])
        trainer.train(resume_from_checkpoint=resume_checkpoint(run))

The Trainer saves and loads its own checkpoints (model, optimizer, scheduler, RNG states, its
place in the data); ETT adds the commit marker and manifest (ett/folders.py) once every rank has
written its part, so a folder torn by a kill, or corrupted later, is never resumed from. The
job's checkpoint interval (`run.interval_steps`) asks the Trainer for a save on top of its own
`save_strategy`.
"""

import re
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ett.folders import first_verified, folder_manifest, resume_candidates, write_marker
from ett.run import Run, Step

CHECKPOINT_FOLDER = re.compile(r"^checkpoint-(\d+)$")  # the Trainer's PREFIX_CHECKPOINT_DIR


def resume_checkpoint(run: Run, output_dir: str | None = None) -> str | None:
    """The newest `checkpoint-N` under the job's folder (or `output_dir`) that verifies, starting
    from the one the service named; None when there is none (train from the start). Each one
    skipped is logged with its reason. Marks the start of the restore for the report."""
    root = output_dir or run.checkpoint_dir
    named = run.resume_from if run.resume_from and CHECKPOINT_FOLDER.match(Path(run.resume_from).name) else None
    folder = first_verified(resume_candidates(root, named, CHECKPOINT_FOLDER))
    if folder is None:
        return None
    run.emit("restore_start")
    return str(folder)


class ETTCallback(TrainerCallback):
    """Reports a Trainer's run to ETT. `tokens_per_step`: tokens of one optimizer step across all
    ranks, when known (the report's throughput)."""

    def __init__(self, run: Run, tokens_per_step: int | None = None):
        self.run, self.tokens_per_step = run, tokens_per_step
        self._step: Step | None = None
        self._saving_step: int | None = None
        # Start-up from here (the Trainer is built next) to the start of training, unless the
        # script marks it itself with `run.initializing()`.
        self._marks_init = run._begin_init()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._marks_init:
            self.run._end_init()
        # The Trainer has loaded the checkpoint resume_checkpoint() chose (model, optimizer,
        # scheduler; RNG states follow at the epoch's start).
        if state.global_step > 0:
            self.run.restored(state.global_step)
        self.run.total_steps = state.max_steps or None  # a straggler's cost is weighed over the steps left

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._step = self.run.step(state.global_step + 1, tokens=self.tokens_per_step).__enter__()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self.run.checkpoint_due(state.global_step):
            control.should_save = True
        if self.run.should_stop():  # SIGTERM (Slurm's time limit, a preemption): save, then stop
            control.should_save = control.should_training_stop = True
        if control.should_save:  # the Trainer saves right after this callback (and any evaluation)
            self._saving_step = state.global_step
            self.run.emit("ckpt_start", step=state.global_step)
        return control

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.run.progress()  # evaluation is work outside steps: not a hang

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        step = state.global_step
        folder = Path(args.output_dir) / f"checkpoint-{step}"
        if self._saving_step != step:  # a save we did not see coming (the end of training)
            self.run.emit("ckpt_start", step=step)
        self._saving_step = None
        self.run.emit("ckpt_staged", step=step)  # the Trainer's save is synchronous: it blocked until now
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank has written its part (each writes its own RNG state)
        if state.is_world_process_zero and folder.is_dir():
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            nbytes = write_marker(folder, step, world_size, folder_manifest(folder))
            self.run.emit("ckpt_committed", step=step, path=str(folder), bytes=nbytes)
