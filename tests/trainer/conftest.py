"""Real trainer runs shared by the checkpoint, resume and event tests: each torchrun launch costs
seconds of CPU, so the three runs below serve every assertion about them.

All three: 2 ranks under torchrun, tiny model, expert parallelism 2, ZeRO-3.
- straight: 8 steps in one go, a checkpoint every 2 steps, keep 2, through a node-local folder
  (`--checkpoint.local_dir`, copied to the checkpoint folder in the background).
- killed: a checkpoint every 4 steps; the step-8 save is torn: rank 1's shard file is a FIFO, so
  its write hangs as on a stalled disk, and every rank is SIGKILLed once rank 0 wrote its shard.
- resumed: attempt 1 in the killed run's checkpoint folder, `--checkpoint.resume_from auto`,
  to step 8.
"""

import os
import shutil
from dataclasses import dataclass

import pytest

from tests.trainer.trainer_runs import TINY_EP_ZERO3, TrainerRun, has_event, local_checkpoint_dir, run_trainer


@dataclass
class KilledRun:
    run: TrainerRun
    folders: dict[str, list[str]]  # checkpoint folder -> its files, right after the kill


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory) -> TrainerRun:
    workdir = tmp_path_factory.mktemp("straight")
    run = run_trainer(workdir, [*TINY_EP_ZERO3, "--train.steps", "8", "--checkpoint.interval_steps", "2", "--checkpoint.keep", "2",
                                "--checkpoint.local_dir", str(local_checkpoint_dir(workdir))])
    assert run.returncode == 0, run.stderr
    return run


@pytest.fixture(scope="session")
def killed_run(tmp_path_factory) -> KilledRun:
    workdir = tmp_path_factory.mktemp("killed")
    torn = workdir / "ckpt" / "step-00000008"

    def tear_step_8_then_kill(events: list[dict]) -> bool:
        if has_event(events, "step", 1) and not torn.exists():  # after the start, which clears newer folders
            torn.mkdir(parents=True)
            os.mkfifo(torn / "__1_0.distcp")
        return has_event(events, "ckpt_staged", 8) and (torn / "__0_0.distcp").exists()

    # The step-8 save can never complete, so the run never ends: the kill always comes first.
    run = run_trainer(workdir, [*TINY_EP_ZERO3, "--train.steps", "8", "--checkpoint.interval_steps", "4"],
                      signal_when=tear_step_8_then_kill)
    assert run.returncode != 0, "the run was not killed"
    folders = {p.name: sorted(os.listdir(p)) for p in run.checkpoint_dir.iterdir()}
    return KilledRun(run, folders)


@pytest.fixture(scope="session")
def resumed_run(killed_run: KilledRun, tmp_path_factory) -> TrainerRun:
    run = run_trainer(
        tmp_path_factory.mktemp("resumed"),
        [*TINY_EP_ZERO3, "--train.steps", "8", "--checkpoint.interval_steps", "4", "--checkpoint.resume_from", "auto"],
        checkpoint_dir=killed_run.run.checkpoint_dir, attempt=1,
    )
    assert run.returncode == 0, run.stderr
    return run


@pytest.fixture(scope="session")
def forgetful_run(killed_run: KilledRun, tmp_path_factory) -> TrainerRun:
    """As `resumed`, from a copy of the killed run's step-4 checkpoint, but without restoring the
    ranks' generators (tests/trainer/checkpoints/forgetful_resume.py)."""
    workdir = tmp_path_factory.mktemp("forgetful")
    shutil.copytree(killed_run.run.checkpoint_dir / "step-00000004", workdir / "ckpt" / "step-00000004")
    run = run_trainer(
        workdir, [*TINY_EP_ZERO3, "--train.steps", "8", "--checkpoint.interval_steps", "4",
                  "--checkpoint.resume_from", "auto"], attempt=1, module="tests.trainer.checkpoints.forgetful_resume",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run
