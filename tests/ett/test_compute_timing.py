"""Per-rank timing sees compute in an FSDP2 script on the library (issue #50), with no call of
its own beyond `run.step`: two torchrun ranks on gloo, rank 1 slow inside its forwards; the waits
of rank 0 in FSDP2's all-gathers are taken off its work (ett/waits.py)."""

import os
import sys

from ett.protocol import EVENTS_DIR, rank_spool
from tests.support import warm
from tests.trainer.trainer_runs import REPO, read_events

SLOW_SECONDS = 0.02  # in each of the script's 4 blocks' forwards: 0.08 s a step on rank 1


def last_window(event_dir, rank: int) -> dict:
    return [e["data"] for e in read_events(event_dir / rank_spool(rank)) if e["kind"] == "step_timing"][-1]


def test_an_fsdp2_rank_slow_in_its_forward_shows_more_work_than_its_peer(tmp_path):
    event_dir = tmp_path / EVENTS_DIR
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETT_", "RANK", "WORLD_SIZE"))}
    env.update(ETT_JOB_ID="fsdp-timing", ETT_ATTEMPT="0", ETT_EVENT_DIR=str(event_dir), OMP_NUM_THREADS="1")
    with open(tmp_path / "output.log", "w") as output:  # torchrun and its ranks forked warm (tests/support/warm.py)
        run = warm.torchrun(2, [sys.executable, "-m", "tests.ett.fsdp_ranks", "10", "1", str(SLOW_SECONDS)],
                            tmp_path / "runners", REPO, env, output.fileno(), output.fileno())
    assert run.wait(timeout=300) == 0, (tmp_path / "output.log").read_text()[-4000:]
    fast, slow = last_window(event_dir, 0), last_window(event_dir, 1)
    assert fast["steps"] == slow["steps"] == 5
    injected = 4 * SLOW_SECONDS
    assert slow["work"] >= injected
    assert slow["work"] - fast["work"] > 0.6 * injected
    assert fast["duration"] - fast["work"] > 0.6 * injected  # rank 0's wait, off its work
