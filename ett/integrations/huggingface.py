"""The Hugging Face Trainer under ETT: `ETTCallback` records start-up, steps and saves, and marks
each `checkpoint-N` folder the Trainer writes as committed; `resume_checkpoint` gives
`trainer.train(resume_from_checkpoint=...)` the newest one that verifies.

    with ett.init() as run:
        args = TrainingArguments(output_dir=run.checkpoint_dir or "out", save_strategy="no", ...)
        trainer = Trainer(model, args, train_dataset=data, callbacks=[ETTCallback(run)])
        trainer.train(resume_from_checkpoint=resume_checkpoint(run))

The Trainer saves and loads its own checkpoints (model, optimizer, scheduler, RNG states, its
place in the data), synchronously, at the job's interval: the persistent tier only. ETT's per-step
snapshots and their copies on a peer node are not taken for it (they snapshot the state a script
hands `run.checkpoint`); a job that asks for them is told so in its log. ETT adds the commit
marker and manifest (ett/checkpoints/folders.py) once every rank has written its part, so a folder torn by a
kill, or corrupted later, is never resumed from. The job's checkpoint interval (`run.interval_steps`) asks the Trainer for a save on top of its own
`save_strategy`.
"""

import re
from pathlib import Path

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ett.run import Run

CHECKPOINT_FOLDER = re.compile(r"^checkpoint-(\d+)$")  # the Trainer's PREFIX_CHECKPOINT_DIR


def resume_checkpoint(run: Run, output_dir: str | None = None) -> str | None:
    """The newest `checkpoint-N` under the job's folder (or `output_dir`) that verifies, starting
    from the one the service named; None when there is none (train from the start). Each one
    skipped is logged with its reason. Marks the start of the restore for the report."""
    found = run.resume_folder(CHECKPOINT_FOLDER, output_dir)
    return found.folder if found else None


class ETTCallback(TrainerCallback):
    """Reports a Trainer's run to ETT. `tokens_per_step`: tokens of one optimizer step across all
    ranks, when known (the report's throughput)."""

    def __init__(self, run: Run, tokens_per_step: int | None = None):
        self.run, self.tokens_per_step = run, tokens_per_step
        self._saving_step: int | None = None
        # Start-up from here (the Trainer is built next) to the start of training, unless the
        # script marks it itself with `run.initializing()`.
        self._marks_init = run.begin_init()
        run.saves_its_own_checkpoints("the Hugging Face Trainer")

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._marks_init:
            self.run.end_init()
        # The Trainer has loaded the checkpoint resume_checkpoint() chose (model, optimizer,
        # scheduler; RNG states follow at the epoch's start).
        if state.global_step > 0:
            self.run.restored(state.global_step)
        self.run.total_steps = state.max_steps or None  # a straggler's cost is weighed over the steps left

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.run.begin_step(state.global_step + 1, tokens=self.tokens_per_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.run.end_step()
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
        # Once every rank has written its part (its RNG state). The Trainer rotates its own folders
        # (`save_total_limit`), sparing its best one, which a prune of ours would not know.
        self.run.commit_folder(folder, step, apply_keep=False)
