"""The library a script calls (ett.init, Run) in this process: inert outside a job, the events
and checkpoints of a job inside one, and a clear error for each misuse."""

import json
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ett
from ett.checkpoint import CheckpointConfig
from ett.checkpoints.folders import step_folders
from ett.protocol import EVENTS_DIR, INTERVAL_FILE, MARKER, progress_file, rank_spool
from ett.run import Run
from tests.trainer.trainer_runs import read_events


@pytest.fixture(autouse=True)
def no_ett_environment(monkeypatch):
    for name in ("ETT_JOB_ID", "ETT_ATTEMPT", "ETT_EVENT_DIR", "ETT_CHECKPOINT_DIR", "ETT_CHECKPOINT_LOCAL_DIR",
                 "ETT_RESUME_FROM", "ETT_CHECKPOINT_INTERVAL_STEPS", "ETT_CHECKPOINT_KEEP", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():  # the one-rank group a Run made for itself
        dist.destroy_process_group()


@pytest.fixture
def in_job(monkeypatch, tmp_path):
    monkeypatch.setenv("ETT_JOB_ID", "job1")
    monkeypatch.setenv("ETT_ATTEMPT", "2")
    monkeypatch.setenv("ETT_EVENT_DIR", str(tmp_path / EVENTS_DIR))
    monkeypatch.setenv("ETT_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("ETT_CHECKPOINT_INTERVAL_STEPS", "2")
    monkeypatch.setenv("ETT_CHECKPOINT_KEEP", "5")
    return tmp_path


def model_state() -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, {"app": ett.ModelOptimizerState(model, optimizer)}


def train(run: Run, model, optimizer, state, steps: range) -> None:
    for step in steps:
        with run.step(step, tokens=8) as s:
            loss = model(torch.full((2, 4), float(step))).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            s.loss = loss
        run.checkpoint(step, state)


def test_outside_a_job_a_run_records_nothing_and_saves_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, optimizer, state = model_state()
    with ett.init(interval_steps=1) as run:
        assert not run.in_job and run.job_id is None and run.checkpoint_dir is None
        with run.initializing():
            pass
        assert run.restore(state) == 0
        train(run, model, optimizer, state, range(1, 4))
        assert run.checkpoint(3, state, force=True) is False
        run.progress()
    assert list(tmp_path.iterdir()) == [] and not dist.is_initialized()


def test_outside_a_job_a_named_folder_gets_checkpoints_and_resume(tmp_path):
    model, optimizer, state = model_state()
    with ett.init(checkpoint_dir=tmp_path / "ckpt", interval_steps=2) as run:
        train(run, model, optimizer, state, range(1, 6))
    assert [f.name for f in step_folders(tmp_path / "ckpt")] == ["step-00000004", "step-00000002"]
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # after step 5, not saved

    model2, optimizer2, state2 = model_state()
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        assert run.restore(state2) == 4
        train(run, model2, optimizer2, state2, range(5, 6))
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())


def test_inside_a_job_the_events_and_checkpoints_follow_the_job(in_job):
    model, optimizer, state = model_state()
    with ett.init(checkpoint_dir=in_job / "ignored", interval_steps=100) as run:
        assert (run.job_id, run.attempt, run.rank, run.interval_steps, run.keep) == ("job1", 2, 0, 2, 5)
        with run.initializing():
            pass
        assert run.restore(state) == 0
        train(run, model, optimizer, state, range(1, 4))
        run.progress()
    assert not (in_job / "ignored").exists(), "the job's folder wins over the script's"
    events = read_events(in_job / EVENTS_DIR / rank_spool(0))
    # The commit is written in the background: anywhere after its staging, before train_end.
    [committed] = [e for e in events if e["kind"] == "ckpt_committed"]
    assert [(e["kind"], e["step"]) for e in events if e is not committed] == [
        ("init_start", None), ("init_end", None), ("step", 1),
        ("step", 2), ("ckpt_start", 2), ("ckpt_staged", 2),
        ("step", 3), ("step_timing", 3), ("train_end", 3),  # a partial timing window at the end
    ]  # fmt: skip
    assert 5 < events.index(committed) < len(events) - 1
    assert committed["step"] == 2 and committed["data"]["path"] == str(in_job / "ckpt" / "step-00000002")
    assert all(e["attempt"] == 2 and e["source"] == "rank:0" for e in events)
    step = events[2]["data"]
    assert step["tokens"] == 8 and step["duration"] > 0 and isinstance(step["loss"], float)
    # The progress mark: the last step, one liveness beat, nothing unwritten or dropped, and no
    # background write any more (the save of step 2 is committed); closed, so no pulse.
    assert (in_job / EVENTS_DIR / progress_file(0)).read_text().split() == ["3", "1", "0", "0", "0", "0"]


class FailsToSave:
    """A Stateful whose second save fails, as a full disk or a bad tensor would."""

    def __init__(self):
        self.saves = 0

    def state_dict(self) -> dict:
        self.saves += 1
        if self.saves == 2:
            raise OSError(28, "No space left on device")
        return {"value": torch.tensor([self.saves])}

    def load_state_dict(self, state: dict) -> None:
        self.saves = int(state["value"])


def test_a_failed_save_is_never_offered_for_resume(in_job):
    model, optimizer, state = model_state()
    state["flaky"] = FailsToSave()
    with ett.init() as run:
        train(run, model, optimizer, state, range(1, 5))  # saves at 2 (good) and 4 (fails)
    events = read_events(in_job / EVENTS_DIR / rank_spool(0))
    assert [e["step"] for e in events if e["kind"] == "ckpt_failed"] == [4]
    assert "No space left" in next(e for e in events if e["kind"] == "ckpt_failed")["data"]["error"]

    model2, optimizer2, state2 = model_state()
    state2["flaky"] = FailsToSave()
    with ett.init() as run:
        assert run.restore(state2) == 2


def test_restore_names_what_the_checkpoint_holds_that_the_template_lacks(tmp_path, caplog):
    model, optimizer, state = model_state()
    saved = {**state, "ema": {"decay": torch.tensor(0.99)}, "sampler": {"epoch": 3}}
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        train(run, model, optimizer, state, range(1, 2))
        run.checkpoint(1, saved, force=True)
    model2, optimizer2, state2 = model_state()
    with caplog.at_level(logging.WARNING, logger="ett"), ett.init(checkpoint_dir=tmp_path / "ckpt") as run:
        assert run.restore(state2) == 1
        assert run.keys_not_restored == ["ema.decay", "sampler.epoch"]  # loaded: nothing of them
    assert ("2 entries held by the checkpoint but with no place in the state given, not loaded: ema.decay, "
            "sampler.epoch") in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_a_framework_marks_its_steps_and_start_up_in_pairs(in_job):
    with ett.init() as run:
        assert run.begin_init() and not run.begin_init()  # once a run
        run.end_init()
        run.begin_step(1, tokens=8)
        with pytest.raises(ett.UsageError, match=r"run.begin_step\(2\): step 1 has not ended"):
            run.begin_step(2)
        run.end_step(loss=0.5)
        with pytest.raises(ett.UsageError, match=r"run.end_step\(\): no step was begun"):
            run.end_step()
    events = read_events(in_job / EVENTS_DIR / rank_spool(0))
    assert [e["kind"] for e in events if e["kind"] != "step_timing"] == ["init_start", "init_end", "step", "train_end"]
    step = next(e for e in events if e["kind"] == "step")
    assert (step["step"], step["data"]["loss"], step["data"]["tokens"]) == (1, 0.5, 8)


def test_step_numbers_must_increase(tmp_path):
    with ett.init() as run:
        with run.step(3):
            pass
        with pytest.raises(ett.UsageError, match=r"run.step\(3\): step numbers must increase; the last step was 3"):
            run.step(3)
        with pytest.raises(ett.UsageError, match=r"run.step\(0\): a step number is an integer >= 1"):
            run.step(0)


def test_a_step_that_raises_is_not_recorded(in_job):
    with ett.init() as run:
        with pytest.raises(RuntimeError), run.step(1):
            raise RuntimeError("out of memory")
        with run.step(1):  # the same step again: it never happened
            pass
    assert [e["step"] for e in read_events(in_job / EVENTS_DIR / rank_spool(0)) if e["kind"] == "step"] == [1]


def test_a_checkpoint_folder_that_cannot_be_written_is_named(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ett.UsageError, match=rf"checkpoint folder {tmp_path}/a-file/ckpt cannot be written"):
        ett.init(checkpoint_dir=tmp_path / "a-file" / "ckpt")


def test_a_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("ETT_CHECKPOINT_INTERVAL_STEPS", "often")
    with pytest.raises(ett.UsageError, match="ETT_CHECKPOINT_INTERVAL_STEPS: expected an integer, got 'often'"):
        ett.init()


def test_a_job_of_several_ranks_must_initialise_torch_distributed_first(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = ett.init(checkpoint_dir=tmp_path)
    with pytest.raises(ett.UsageError, match="call torch.distributed.init_process_group before run.restore"):
        run.restore({})


def test_resume_skips_a_corrupt_newest_checkpoint_and_says_so(tmp_path, caplog):
    model, optimizer, state = model_state()
    with ett.init(checkpoint_dir=tmp_path, interval_steps=2) as run:
        train(run, model, optimizer, state, range(1, 5))
    shard = next((tmp_path / "step-00000004").glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)  # same size, other bytes
    torn = tmp_path / "step-00000006"  # a save killed before its marker
    torn.mkdir()
    (torn / ".metadata").write_bytes(b"partial")
    model2, optimizer2, state2 = model_state()
    with caplog.at_level(logging.WARNING, logger="ett"), ett.init(checkpoint_dir=tmp_path) as run:
        assert run.restore(state2) == 2
    said = caplog.text
    assert f"skipping checkpoint {torn}: no {MARKER} marker (torn" in said
    assert f"skipping checkpoint {tmp_path / 'step-00000004'}: {shard.name} fails its CRC-32 check" in said
    assert f"resuming from {tmp_path / 'step-00000002'}" in said
    assert json.loads((tmp_path / "step-00000002" / MARKER).read_text())["step"] == 2


def test_a_resume_point_outside_the_jobs_folder_is_ignored(in_job, monkeypatch, caplog):
    # Another job's checkpoint, named as this job's resume point: never read (nor pruned beside).
    model, optimizer, state = model_state()
    monkeypatch.setenv("ETT_CHECKPOINT_DIR", str(in_job / "other"))  # the other job
    with ett.init() as other:
        train(other, model, optimizer, state, range(1, 3))
    monkeypatch.setenv("ETT_CHECKPOINT_DIR", str(in_job / "ckpt"))  # this job
    monkeypatch.setenv("ETT_RESUME_FROM", str(in_job / "other" / "step-00000002"))
    model2, optimizer2, state2 = model_state()
    with caplog.at_level(logging.WARNING, logger="ett"), ett.init() as run:
        assert run.resume_from is None and run.restore(state2) == 0
    other_step = in_job / "other" / "step-00000002"
    assert f"ignoring ETT_RESUME_FROM {other_step}: outside the checkpoint folder" in caplog.text
    assert (in_job / "other" / "step-00000002" / MARKER).exists()


def test_a_new_interval_applies_from_its_step_on_every_rank_alike(tmp_path):
    """What the agent writes for a running `auto` job: every rank switches at `from_step`."""
    interval_file = tmp_path / INTERVAL_FILE
    ranks = [CheckpointConfig(dir=str(tmp_path), interval_steps=10, interval_file=str(interval_file)) for _ in range(2)]
    saves: list[list[int]] = [[], []]
    for step in range(1, 41):
        if step == 13:  # the service's command arrives mid-run: 4 from step 22
            staging = tmp_path / "staging"
            staging.write_text("4 22\n")
            staging.replace(interval_file)
        for rank, cfg in enumerate(ranks):
            if cfg.due(step):
                saves[rank].append(step)
    assert saves[0] == saves[1] == [10, 20, 24, 28, 32, 36, 40]


def test_two_new_intervals_that_arrive_together_each_apply_from_their_own_step(tmp_path):
    """The agent may get two changes in one answer before the first one's step: both hold."""
    interval_file = tmp_path / INTERVAL_FILE
    cfg = CheckpointConfig(dir=str(tmp_path), interval_steps=10, interval_file=str(interval_file))
    saves = []
    for step in range(1, 41):
        if step == 13:  # 4 from step 22, then 6 from step 30, written before step 22
            interval_file.write_text("4 22\n6 30\n")
        if cfg.due(step):
            saves.append(step)
    assert saves == [10, 20, 24, 28, 30, 36]


def test_a_saves_blocking_inside_a_step_is_told_in_its_step_event_and_one_between_steps_is_not(in_job):
    """The step event's `saving`: what the step spent blocked on a save, which the report books as
    checkpoint time and never again as slow (service/accounting/step_times.py)."""
    model, optimizer, state = model_state()
    with ett.init() as run:
        with run.step(1):  # the built-in trainer's way: the save's copy waited for inside a step
            run.checkpoint(1, state, force=True)
        with run.step(2):
            pass
        run.checkpoint(2, state, force=True)  # a library script's way: between steps
        with run.step(3):
            pass
    steps = {e["step"]: e["data"] for e in read_events(in_job / EVENTS_DIR / rank_spool(0)) if e["kind"] == "step"}
    assert steps[1]["saving"] > 0 and steps[1]["saving"] <= steps[1]["duration"]
    assert "saving" not in steps[2] and "saving" not in steps[3]


def test_a_frozen_parameter_with_snapshots_on_keeps_every_save_and_resumes(in_job):
    """A parameter the optimizer does not hold (a frozen layer, LoRA's base): the fast tier's
    snapshot walks every parameter, and an entry it made in the optimizer's state (a defaultdict)
    broke `optimizer.state_dict()`, so every persistent save after the first snapshot failed."""
    tiers = CheckpointConfig(dir=str(in_job / "ckpt"), local_dir=str(in_job / "local"), interval_steps=2,
                             snapshots=True, snapshot_every=1)  # a snapshot at every step, whatever its cost

    def frozen_model_state() -> tuple[nn.Module, torch.optim.Optimizer, dict]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        model[0].weight.requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        return model, optimizer, {"app": ett.ModelOptimizerState(model, optimizer)}

    model, optimizer, state = frozen_model_state()
    with ett.init() as run:
        run.configure_checkpoints(tiers)
        train(run, model, optimizer, state, range(1, 6))
    assert model[0].weight not in optimizer.state and len(optimizer.state) == 3
    optimizer.state_dict()
    events = read_events(in_job / EVENTS_DIR / rank_spool(0))
    assert [e["step"] for e in events if e["kind"] == "ckpt_committed"] == [2, 4]
    assert not [e for e in events if e["kind"] == "ckpt_failed"], events
    dist.destroy_process_group()

    model, optimizer, state = frozen_model_state()
    with ett.init() as run:
        run.configure_checkpoints(tiers)
        assert run.restore(state) == 5  # the snapshot of step 5, newer than the checkpoint of step 4
    assert model[0].weight not in optimizer.state and len(optimizer.state) == 3
    assert optimizer.state_dict()["state"].keys() == {0, 1, 2}
