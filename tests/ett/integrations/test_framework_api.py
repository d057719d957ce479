"""The framework API (ett/framework.py) as a user calls it: `resume_folder` with a regular
expression as a string or a format such as "step_{step}", returning the folder and its step;
`run.saving(step, folder)` booking a save's start, staging and end; `commit_folder` keeping the
newest `keep`. One process, real folders, the events as the agent would read them."""

import re
from pathlib import Path

import pytest
import torch.distributed as dist

import ett
from ett.checkpoints.folders import verify
from ett.protocol import EVENTS_DIR, MARKER, rank_spool
from tests.trainer.trainer_runs import read_events


@pytest.fixture(autouse=True)
def no_ett_environment(monkeypatch):
    for name in ("ETT_JOB_ID", "ETT_ATTEMPT", "ETT_EVENT_DIR", "ETT_CHECKPOINT_DIR", "ETT_CHECKPOINT_LOCAL_DIR",
                 "ETT_RESUME_FROM", "ETT_CHECKPOINT_INTERVAL_STEPS", "ETT_CHECKPOINT_KEEP", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def job(monkeypatch, tmp_path):
    """Inside a job keeping 2 checkpoints: (its checkpoint folder, its rank 0's events, read on demand)."""
    monkeypatch.setenv("ETT_JOB_ID", "job1")
    monkeypatch.setenv("ETT_EVENT_DIR", str(tmp_path / EVENTS_DIR))
    monkeypatch.setenv("ETT_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("ETT_CHECKPOINT_KEEP", "2")
    return tmp_path / "ckpt", lambda: read_events(tmp_path / EVENTS_DIR / rank_spool(0))


def save_a_folder(run: ett.Run, folder: Path, step: int, **commit) -> None:
    """What a framework's save leaves: its files, then the commit."""
    folder.mkdir(parents=True)
    (folder / "model.bin").write_bytes(bytes([step % 256]) * 64)
    run.commit_folder(folder, step, **commit)


@pytest.mark.parametrize("pattern", [r"step_(\d+)", r"step_(?P<step>\d+)", re.compile(r"^step_(\d+)$"), "step_{step}"])
def test_resume_folder_takes_a_pattern_as_a_user_writes_it_and_gives_the_folder_and_its_step(tmp_path, pattern):
    with ett.init(checkpoint_dir=tmp_path, keep=5) as run:
        for step in (5, 10, 15):
            save_a_folder(run, tmp_path / f"step_{step}", step)
        (tmp_path / "step_15" / "model.bin").write_bytes(b"torn")  # corrupt: skipped
        (tmp_path / "step_20.tmp").mkdir()  # another name: not a checkpoint of the pattern
        found = run.resume_folder(pattern)
    assert found == (str(tmp_path / "step_10"), 10) and found.step == 10 and found.folder.endswith("step_10")


def test_a_format_with_a_width_names_padded_folders(tmp_path):
    with ett.init(checkpoint_dir=tmp_path) as run:
        save_a_folder(run, tmp_path / "ckpt-000040", 40)
        assert run.resume_folder("ckpt-{step:06d}") == (str(tmp_path / "ckpt-000040"), 40)
        assert run.resume_folder("other-{step}") is None  # none of that name: train from the start


@pytest.mark.parametrize(("pattern", "says"), [
    ("step_(", "not a regular expression"),
    (r"step_\d+", "it needs a group for the step"),
    ("{epoch}-{step}", "a format names the step once, as {step}, and nothing else"),
    ("", "give a format such as"),
])
def test_a_pattern_it_cannot_use_is_named_with_what_is_wrong(tmp_path, pattern, says):
    with ett.init(checkpoint_dir=tmp_path) as run, pytest.raises(ett.UsageError) as raised:
        run.resume_folder(pattern)
    assert str(raised.value).startswith(f"checkpoint folder pattern {pattern!r}: ") and says in str(raised.value)


def test_commit_folder_keeps_the_newest_keep_of_its_kind_and_leaves_other_folders(job):
    ckpt, _ = job
    with ett.init() as run:
        (ckpt / "notes").mkdir()
        (ckpt / "step_7_eval").mkdir()  # not of the checkpoints' shape
        for step in (10, 20, 30):
            save_a_folder(run, ckpt / f"step_{step}", step)
    assert sorted(p.name for p in ckpt.iterdir()) == ["notes", "step_20", "step_30", "step_7_eval"]
    assert verify(ckpt / "step_30") is None and verify(ckpt / "step_20") is None


def test_commit_folder_keeps_all_when_told_to_leave_the_framework_its_own_rotation(job):
    ckpt, _ = job
    with ett.init() as run:
        for step in (10, 20, 30):
            save_a_folder(run, ckpt / f"checkpoint-{step}", step, apply_keep=False)
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]


def test_saving_books_the_start_the_staging_and_the_commit_of_a_save(job):
    ckpt, events = job
    with ett.init() as run:
        with run.saving(10, ckpt / "step_10"):  # synchronous: staged as the block ends
            (ckpt / "step_10").mkdir(parents=True)
            (ckpt / "step_10" / "model.bin").write_bytes(b"x" * 10)
        with run.saving(20, ckpt / "step_20") as save:  # the loop goes on while the framework writes
            (ckpt / "step_20").mkdir()
            save.staged()
            (ckpt / "step_20" / "model.bin").write_bytes(b"y" * 20)
        with pytest.raises(OSError), run.saving(30, ckpt / "step_30"):
            raise OSError(28, "No space left on device")
    saves = [(e["kind"], e["step"]) for e in events() if e["kind"].startswith("ckpt_")]
    assert saves == [("ckpt_start", 10), ("ckpt_staged", 10), ("ckpt_committed", 10),
                     ("ckpt_start", 20), ("ckpt_staged", 20), ("ckpt_committed", 20),
                     ("ckpt_start", 30), ("ckpt_failed", 30)]  # fmt: skip
    committed = [e for e in events() if e["kind"] == "ckpt_committed"]
    assert [e["data"]["bytes"] for e in committed] == [10, 20]
    assert "No space left on device" in [e for e in events() if e["kind"] == "ckpt_failed"][0]["data"]["error"]
    assert not (ckpt / "step_30").exists() and (ckpt / "step_20" / MARKER).exists()
    assert not dist.is_initialized()  # the framework API needs no process group of one process


def test_keep_takes_the_steps_digits_where_the_folders_beside_it_vary_when_the_step_is_spelt_twice(job):
    ckpt, _ = job
    with ett.init() as run:
        for step in (5, 10, 15, 20):  # at 20 the name spells 20 twice: 'ckpt_20_of_20'
            save_a_folder(run, ckpt / f"ckpt_{step}_of_20", step)
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt_15_of_20", "ckpt_20_of_20"]


def test_a_group_that_takes_what_is_no_number_names_no_step(tmp_path):
    with ett.init(checkpoint_dir=tmp_path) as run:
        save_a_folder(run, tmp_path / "checkpoint-500", 500)
        (tmp_path / "checkpoint-final").mkdir()  # the user's own, beside them
        assert run.resume_folder(r"checkpoint-(.+)") == (str(tmp_path / "checkpoint-500"), 500)


def test_committing_a_folder_that_is_not_there_is_a_usage_error_naming_it(tmp_path):
    with ett.init(checkpoint_dir=tmp_path) as run, pytest.raises(ett.UsageError, match="no folder: nothing was saved"):
        run.commit_folder(tmp_path / "accelerate-00000005", 5)
