"""Per-rank timing sees compute in the built-in trainer (issue #50): with one rank slow inside its
forward, that rank's work stands out in the step_timing events, its peer's does not: the peer's
waits in FSDP2's collectives are taken off its step (ett/waits.py), and the mark is the end of
backward (trainer/train.py), not where the batch is loaded."""

from tests.trainer.trainer_runs import run_trainer

# In each of the tiny preset's 2 blocks' forwards: 0.3 s a step on rank 1, well above what a loaded
# machine moves either rank's own compute by (0.05 s a block once let that noise decide).
SLOW_SECONDS = 0.15


def last_window(run, rank: int) -> dict:
    return [e["data"] for e in run.events(rank) if e["kind"] == "step_timing"][-1]


def test_a_rank_slow_in_its_forward_shows_more_work_than_its_peer(tmp_path, monkeypatch):
    monkeypatch.setenv("ETT_JOB_ID", "compute-timing")  # a job's run writes step_timing
    monkeypatch.setenv("SLOW_FORWARD_RANK", "1")
    monkeypatch.setenv("SLOW_FORWARD_SECONDS", str(SLOW_SECONDS))
    args = ["--preset", "tiny", "--train.steps", "10"]
    run = run_trainer(tmp_path, args, nproc=2, module="tests.trainer.slow_forward")
    assert run.returncode == 0, run.stderr[-4000:]
    fast, slow = last_window(run, 0), last_window(run, 1)
    assert fast["steps"] == slow["steps"] == 5
    injected = 2 * SLOW_SECONDS
    assert slow["work"] >= injected  # its sleep is work, not a wait
    # Rank 0 waited in the blocks' all-gathers while rank 1 slept: that wait is off its work.
    assert slow["work"] - fast["work"] > 0.6 * injected
    assert fast["duration"] - fast["work"] > 0.6 * injected
