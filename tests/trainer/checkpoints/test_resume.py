"""Exact resume under expert parallelism and ZeRO-3, torn checkpoints, and stopping on SIGTERM,
on real torchrun runs (fixtures in conftest.py)."""

import signal

import pytest

from ett.checkpoints.folders import step_folders, verify
from ett.protocol import MARKER
from ett.protocol import EXIT_STOPPED
from tests.trainer.trainer_runs import has_event, run_trainer

pytestmark = pytest.mark.slow


def test_killed_and_resumed_run_has_the_losses_of_an_uninterrupted_one_bitwise(straight_run, killed_run, resumed_run):
    straight = straight_run.losses()
    assert sorted(straight) == list(range(1, 9))
    assert killed_run.run.losses() == straight  # the kill came after step 8
    resumed = resumed_run.losses()
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[step] == straight[step] for step in resumed), (resumed, straight)


def test_a_resume_that_forgets_the_generators_is_caught_by_the_losses(straight_run, forgetful_run):
    straight, forgetful = straight_run.losses(), forgetful_run.losses()
    assert sorted(forgetful) == [5, 6, 7, 8]
    assert [e["step"] for e in forgetful_run.events(0) if e["kind"] == "restore_end"] == [4]
    # Same weights, optimizer and data at step 4; only dropout's draws differ from step 5 on.
    assert all(forgetful[step] != straight[step] for step in forgetful), (forgetful, straight)


def test_a_checkpoint_torn_by_a_kill_is_skipped_and_the_one_before_it_loaded(killed_run, resumed_run):
    torn = killed_run.folders["step-00000008"]
    assert "__0_0.distcp" in torn and MARKER not in torn and ".metadata" not in torn
    assert MARKER in killed_run.folders["step-00000004"]
    assert "skipping checkpoint" in resumed_run.stderr and f"step-00000008: no {MARKER} marker" in resumed_run.stderr
    for rank in (0, 1):
        restored = [e["step"] for e in resumed_run.events(rank) if e["kind"] == "restore_end"]
        assert restored == [4]


def test_the_resumed_run_commits_over_the_torn_folder(resumed_run):
    folders = step_folders(resumed_run.checkpoint_dir)
    assert [f.name for f in folders] == ["step-00000008", "step-00000004"]
    assert all(verify(f) is None for f in folders)


def test_sigterm_finishes_the_step_saves_and_exits_with_code_4(tmp_path):
    run = run_trainer(
        tmp_path, ["--preset", "tiny", "--train.steps", "1000", "--checkpoint.async_mode", "process"], nproc=None,
        signal_when=lambda events: has_event(events, "step", 3), signum=signal.SIGTERM,
    )
    assert run.returncode == EXIT_STOPPED, run.stderr
    events = run.events()
    last_step = max(e["step"] for e in events if e["kind"] == "step")
    assert last_step >= 3
    assert [e["kind"] for e in events[-4:]] == ["ckpt_start", "ckpt_staged", "ckpt_committed", "train_end"]
    assert all(e["step"] == last_step for e in events[-4:])
    assert [f.name for f in step_folders(run.checkpoint_dir)] == [f"step-{last_step:08d}"]
    assert verify(step_folders(run.checkpoint_dir)[0]) is None
