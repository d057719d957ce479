"""The event spool: the writer itself, and the streams of real runs (conftest.py) against
schema v1 (docs/events.md) and its rules."""

import json
import time

import pytest

from ett.errors import UsageError
from ett.events import EventWriter, read_progress_mark
from ett.protocol import EVENTS_DIR, PULSE_SECONDS, RANK_KINDS, progress_file, rank_spool
from ett.protocol.event_fields import FIELD_NAMES
from tests.trainer.trainer_runs import TINY_EP_ZERO3, read_events, run_trainer


def assert_schema_v1(events: list[dict], rank: int, attempt: int) -> None:
    for event in events:
        assert set(event) == {"kind", "ts", "attempt", "source", "seq", "step", "data"}, event
        assert event["kind"] in RANK_KINDS
        assert isinstance(event["ts"], float) and isinstance(event["data"], dict)
        assert set(event["data"]) <= FIELD_NAMES[event["kind"]], event  # ett/protocol/event_fields.py
        assert event["step"] is None or (isinstance(event["step"], int) and event["step"] >= 0)
        assert event["attempt"] == attempt and event["source"] == f"rank:{rank}"
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs)), "seq must increase strictly"
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)


def kinds(events: list[dict]) -> list[str]:
    return [e["kind"] for e in events]


def test_nothing_is_written_without_a_spool_folder(tmp_path, monkeypatch):
    # Where a writer that wrongly fell back to something would write: the working folder, or the
    # spool folder of the environment.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ETT_EVENT_DIR", str(tmp_path / "from-env"))
    writer = EventWriter(None, rank=0, attempt=0)
    writer.emit("init_start", pid=1)
    writer.progress(1)
    writer.close()
    assert list(tmp_path.iterdir()) == [] and writer.path is None


def test_a_declared_kind_takes_only_its_declared_fields():
    writer = EventWriter(None, rank=0, attempt=0)
    writer.emit("step", step=1, duration=0.5, tokens=64, loss=2.5)
    with pytest.raises(UsageError, match="a step event has no field lr"):
        writer.emit("step", step=2, duration=0.5, lr=3e-4)
    with pytest.raises(UsageError, match="a ckpt_start event has no field path"):
        writer.emit("ckpt_start", step=2, path="/c")


def test_each_event_reaches_the_file_before_close(tmp_path):
    writer = EventWriter(str(tmp_path), rank=3, attempt=2)
    writer.emit("step", step=1, duration=0.5, tokens=64, loss=2.5)
    deadline = time.monotonic() + 5
    while not read_events(tmp_path / rank_spool(3)) and time.monotonic() < deadline:
        time.sleep(0.005)
    [event] = read_events(tmp_path / rank_spool(3))
    assert event["source"] == "rank:3" and event["attempt"] == 2 and event["seq"] == 0
    assert event["data"] == {"duration": 0.5, "tokens": 64, "loss": 2.5}
    writer.close()


def test_a_restarted_rank_continues_the_seq_of_its_attempt_after_a_torn_line(tmp_path):
    spool = tmp_path / rank_spool(0)
    spool.write_text(
        json.dumps({"kind": "step", "ts": 1.0, "attempt": 1, "source": "rank:0", "seq": 0, "step": 1, "data": {}}) + "\n"
        + json.dumps({"kind": "step", "ts": 2.0, "attempt": 1, "source": "rank:0", "seq": 7, "step": 2, "data": {}}) + "\n"
        + '{"kind": "step", "ts": 3.0, "att'  # killed mid-line
    )
    for attempt, expected_seq in ((1, 8), (2, 0)):
        writer = EventWriter(str(tmp_path), rank=0, attempt=attempt)
        writer.emit("init_start", pid=42)
        writer.close()
        assert read_events(spool)[-1]["seq"] == expected_seq


def test_the_straight_run_follows_the_schema_and_the_rules(straight_run):
    events_0, events_1 = straight_run.events(0), straight_run.events(1)
    assert_schema_v1(events_0, rank=0, attempt=0)
    assert_schema_v1(events_1, rank=1, attempt=0)
    for events in (events_0, events_1):
        assert kinds(events)[:2] == ["init_start", "init_end"] and kinds(events)[-1] == "train_end"
        assert isinstance(events[0]["data"]["pid"], int)
        assert "restore_start" not in kinds(events)  # nothing to resume from

    steps = [e for e in events_0 if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 9))  # one per step, rank 0 only
    assert "step" not in kinds(events_1)
    for e in steps:
        assert e["data"]["duration"] > 0 and e["data"]["tokens"] == 2 * 4 * 32 and e["data"]["loss"] > 0

    for saved in (2, 4, 6, 8):
        of_save = [e for e in events_0 if e["step"] == saved and e["kind"].startswith("ckpt_")]
        assert kinds(of_save) == ["ckpt_start", "ckpt_staged", "ckpt_committed"]
        committed = of_save[-1]["data"]
        assert committed["path"].endswith(f"step-{saved:08d}") and committed["bytes"] > 0
        # saved right after its step (the loop goes on after ckpt_staged, before the commit)
        before_start = events_0[: events_0.index(of_save[0])]
        assert [e["step"] for e in before_start if e["kind"] == "step"][-1] == saved
    assert kinds([e for e in events_1 if e["kind"].startswith("ckpt_")]) == ["ckpt_start", "ckpt_staged"] * 4


def test_the_resumed_run_reports_its_restore(resumed_run):
    for rank in (0, 1):
        events = resumed_run.events(rank)
        assert_schema_v1(events, rank=rank, attempt=1)
        assert kinds(events)[:4] == ["init_start", "init_end", "restore_start", "restore_end"]
        assert events[3]["step"] == 4
    assert [e["step"] for e in resumed_run.events(0) if e["kind"] == "step"] == [5, 6, 7, 8]


@pytest.mark.parametrize("rank", [0, 1])
def test_the_killed_run_left_no_commit_for_the_torn_save(killed_run, rank):
    events = killed_run.run.events(rank)
    assert_schema_v1(events, rank=rank, attempt=0)
    assert "train_end" not in kinds(events)
    assert not any(e["kind"] == "ckpt_committed" and e["step"] == 8 for e in events)


@pytest.mark.slow
def test_the_mark_says_while_a_checkpoint_is_written_in_the_background(tmp_path):
    writer = EventWriter(str(tmp_path), rank=1, attempt=0)
    writer.progress(7)
    writer.writing(True)
    writer.progress(None)
    writer.close()
    mark = read_progress_mark(tmp_path / progress_file(1))
    assert (mark.step, mark.beats, mark.writing) == (7, 1, True)
    (tmp_path / progress_file(2)).write_text("5 0 0 0".rjust(64))  # a mark of an older writer
    assert read_progress_mark(tmp_path / progress_file(2)).writing is False


def test_the_marks_pulse_counts_up_while_the_rank_waits_and_is_zero_once_closed(tmp_path):
    writer = EventWriter(str(tmp_path), rank=0, attempt=0)
    writer.progress(3)
    pulses = []
    for _ in range(4):  # nothing emitted meanwhile: the writer thread pulses on its own
        time.sleep(3 * PULSE_SECONDS)
        pulses.append(read_progress_mark(tmp_path / progress_file(0)).pulse)
    assert pulses == sorted(pulses) and len(set(pulses)) == 4 and pulses[0] >= 1, pulses
    writer.close()
    mark = read_progress_mark(tmp_path / progress_file(0))
    assert (mark.step, mark.pulse) == (3, 0)  # closed: no longer a sign of life to judge by


def test_every_trainer_rank_keeps_a_progress_mark_the_agent_reads_step_by_step(tmp_path):
    """The marks the agent's hang detection and step faults read (agent/groups/progress.py), written by
    real trainer ranks: each rank's mark follows its steps while it trains, and ends at the last."""
    seen: dict[int, list[int]] = {0: [], 1: []}

    def sample(_events: list[dict]) -> bool:
        for rank in seen:
            mark = read_progress_mark(tmp_path / EVENTS_DIR / progress_file(rank))
            if mark is not None and (not seen[rank] or seen[rank][-1] != mark.step):
                seen[rank].append(mark.step)
        return False  # never signal: only watch

    run = run_trainer(tmp_path, [*TINY_EP_ZERO3, "--train.steps", "6"], signal_when=sample)
    assert run.returncode == 0, run.stderr
    for rank, steps in seen.items():
        final = read_progress_mark(run.event_dir / progress_file(rank))
        assert final is not None and final.step == 6 and (final.unwritten, final.dropped) == (0, 0)
        assert not final.writing  # the last save is committed before the rank ends
        assert steps == sorted(steps) and len(set(steps) - {0}) >= 3, (rank, steps)  # seen advancing
