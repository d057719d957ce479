"""SIGTERM in a job (Slurm's time limit or preemption, the agent's stop) reaching only some ranks:
every rank finishes the same step, that step's checkpoint is committed, and each rank exits with
ett.EXIT_STOPPED. Real ranks of examples/plain_ddp.py under torchrun."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ett.protocol import EVENTS_DIR, MARKER, rank_spool
from tests.support.waiting import wait_for
from tests.trainer.trainer_runs import read_events

pytestmark = pytest.mark.slow
PLAIN_DDP = Path(__file__).parents[3] / "examples" / "plain_ddp.py"


def wait_for_event(path: Path, kind: str, timeout: float = 60) -> dict:
    """The newest `kind` event in the spool at `path`, once there is one."""
    found = wait_for(lambda: [e for e in read_events(path) if e["kind"] == kind], timeout, f"a {kind} event in {path}")
    return found[-1]


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_and_its_checkpoint(tmp_path):
    events, checkpoints = tmp_path / EVENTS_DIR, tmp_path / "ckpt"
    env = os.environ | {"ETT_JOB_ID": "job1", "ETT_ATTEMPT": "0", "ETT_EVENT_DIR": str(events),
                        "ETT_CHECKPOINT_DIR": str(checkpoints), "ETT_CHECKPOINT_INTERVAL_STEPS": "1000",
                        "OMP_NUM_THREADS": "1"}  # fmt: skip
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(PLAIN_DDP), "--steps", "100000", "--step-seconds", "0.05"]  # fmt: skip
    torchrun = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
    try:
        rank1 = wait_for_event(events / rank_spool(1), "init_start")["data"]["pid"]
        wait_for_event(events / rank_spool(0), "step")
        os.kill(rank1, signal.SIGTERM)  # rank 0 gets none
        output, _ = torchrun.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(torchrun.pid, signal.SIGKILL)  # the ranks too, whatever happened
        torchrun.wait()
    ends = [wait_for_event(events / rank_spool(r), "train_end")["step"] for r in (0, 1)]
    assert ends[0] == ends[1], ends
    step = ends[0]
    committed = sorted(p.name for p in checkpoints.iterdir() if (p / MARKER).exists())
    assert committed == [f"step-{step:08d}"], committed  # the stop's checkpoint: nothing else was due
    assert output.count("exitcode  : 4") == 2, output  # both ranks: ett.EXIT_STOPPED
    assert "SIGTERM: stopped after step" in output, output
