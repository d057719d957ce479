"""A team's own training scripts (examples/) as ETT jobs: the real service, two real agents, real
torchrun ranks; a rank SIGKILLed mid-run. Each run is compared with the same script run under
plain torchrun, with no ETT around it."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.cluster import (
    REPO,
    Cluster,
    assert_categories_sum_to_wall,
    cluster,
    events,
    example_job,
    named_checkpoint_step,
)
from ett.checkpoints.folders import verify
from ett.protocol import MARKER
from tests.support.processes import pids_with_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

KILL = {"attempt": 0, "rank": 1, "at_step": 13, "action": "kill"}


def plain_torchrun(script: str, *args: str, ranks: int = 2, env: dict[str, str] | None = None) -> None:
    """The script under plain torchrun on one node with `ranks` ranks: no ETT variable set but those of
    `env` (ETT_EVENT_DIR: its events, the losses of its steps). Output goes to files, not pipes: a
    rank left behind must not keep the test waiting for their end."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(REPO / "examples" / script), *args]
    marker = uuid.uuid4().hex  # on torchrun and its ranks (each in a session of its own)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETT_")} | {"OWN_SCRIPT_RUN": marker, **(env or {})}
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            for pid in pids_with_env("OWN_SCRIPT_RUN", marker):
                os.kill(pid, signal.SIGKILL)
            process.wait()
        output.seek(0)
        log = output.read()[-4000:]
    assert process.returncode == 0, f"{script} under plain torchrun: exit {process.returncode}; its output ends:\n{log}"


def run_with_a_kill(c: Cluster, spec: dict, kill: dict = KILL, **agent: Any) -> dict:
    """Starts two agents (`agent`: Cluster.start_agent's arguments), submits the job with rank 1
    SIGKILLed at step 13 of attempt 0 (or as `kill` says); checks the recovery."""
    c.start_agent("node-a", **agent), c.start_agent("node-b", **agent)
    job_id = c.submit(**spec, faults=[kill])
    job = c.wait_job(job_id, timeout=300)
    assert job["state"] == "succeeded", c.logs()
    first, second = c.attempts(job, 2)
    assert first["cause"] == "signal" and second["state"] == "succeeded"
    # A successful attempt's ranks leave nothing behind (DCP's checkpoint process included).
    assert f"attempt {job_id}/1: killed" not in c.logs()

    # The second attempt restored the checkpoint the service named: the newest committed when it was scheduled.
    newest = named_checkpoint_step(c, job_id)
    [restore] = [e for e in events(c, job_id, "restore_end") if e.attempt == 1 and e.source == "rank:0"]
    assert restore.step == newest and second["resume_from"].endswith(str(newest))

    # The report is as whole as the built-in trainer's.
    report = c.report(job_id)
    assert_categories_sum_to_wall(report)
    assert report["seconds"]["productive"] > 0 and report["seconds"]["init"] > 0
    [failure] = report["failures"]
    last_of_first = max(e.step for e in events(c, job_id, "step") if e.attempt == 0)
    assert failure["cause"] == "signal" and failure["lost_steps"] == last_of_first - newest
    assert failure["time_to_recover_seconds"] > 0
    assert report["checkpoints"]["committed"] >= 3 and report["checkpoints"]["mean_blocking_seconds"] >= 0
    return job


def uninterrupted_then_as_a_job(tmp_path: Path, script: str, job_file: str, out_flag: str, suffix: str,
                                *plain_args: str) -> tuple[Path, Path]:
    """The script under plain torchrun and, meanwhile, its job file on 2 agents with a kill (the
    two mostly wait: side by side they take the time of the longer); each writes its result
    (`out_flag` FILE); the two files."""
    plain, as_job = tmp_path / f"plain.{suffix}", tmp_path / f"ett.{suffix}"
    spec = example_job(job_file)
    spec["entrypoint"] = [*spec["entrypoint"], out_flag, str(as_job)]
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(plain_torchrun, script, *plain_args, out_flag, str(plain))
        with cluster(tmp_path) as c:
            run_with_a_kill(c, spec)
        uninterrupted.result()
    return plain, as_job


def assert_same_parameters(plain: Path, as_job: Path) -> None:
    uninterrupted, resumed = torch.load(plain), torch.load(as_job)
    assert uninterrupted.keys() == resumed.keys()
    assert all(torch.equal(uninterrupted[name], resumed[name]) for name in uninterrupted)


def test_plain_ddp_job_recovers_and_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    assert_same_parameters(*uninterrupted_then_as_a_job(tmp_path, "plain_ddp.py", "plain_ddp.toml", "--out", "pt",
                                                        "--steps", "40", "--checkpoint-dir", str(tmp_path / "plain")))


@pytest.mark.over_budget("the Hugging Face Trainer, twice: as a job with a kill and uninterrupted")
def test_hf_trainer_job_recovers_and_its_losses_after_resume_match_the_uninterrupted_run(tmp_path):
    plain, as_job = uninterrupted_then_as_a_job(tmp_path, "hf_trainer.py", "hf_trainer.toml", "--losses", "json",
                                                "--steps", "30", "--output-dir", str(tmp_path / "plain"))
    uninterrupted, resumed = json.loads(plain.read_text()), json.loads(as_job.read_text())
    # The Trainer restores weights, optimizer, scheduler and each rank's RNG, and skips the batches
    # its seeded sampler already gave; on CPU every kernel is deterministic and a 2-rank all-reduce
    # adds the same two numbers: the losses are equal to the last bit, not merely close.
    assert resumed == uninterrupted and len(resumed) == 30


def test_lightning_job_recovers_mid_epoch_and_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    # Killed at step 13, resumed from step 10: the 10th of the epoch's 12 batches. Lightning loads
    # its checkpoint, the callback each rank's RNG, the loader goes on with the 11th batch.
    assert_same_parameters(*uninterrupted_then_as_a_job(tmp_path, "lightning.py", "lightning.toml", "--out", "pt",
                                                        "--steps", "40", "--checkpoint-dir", str(tmp_path / "plain")))


@pytest.mark.over_budget("Accelerate, twice (as a job with a kill, uninterrupted), and a third job cancelled")
def test_accelerate_job_resumes_mid_epoch_bitwise_keeps_its_newest_and_a_cancel_saves_and_stops(tmp_path):
    plain, as_job = tmp_path / "plain.pt", tmp_path / "ett.pt"
    spec = example_job("accelerate.toml")
    spec["entrypoint"] = [*spec["entrypoint"], "--out", str(as_job)]
    endless = example_job("accelerate.toml", name="accelerate-cancelled")
    endless["entrypoint"] = [*endless["entrypoint"][:3], "100000", *endless["entrypoint"][4:]]
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(plain_torchrun, "accelerate_loop.py", "--steps", "40", "--checkpoint-dir",
                                    str(tmp_path / "plain"), "--out", str(plain))
        with cluster(tmp_path) as c:
            # Killed at step 25 (the 1st batch of the 3rd epoch is step 25: 12 batches an epoch), it
            # resumes from step 20, the 8th batch of the 2nd epoch: skip_first_batches goes on there.
            job = run_with_a_kill(c, spec, kill=KILL | {"at_step": 25})
            job_id = job["id"]
            [restore] = [e for e in events(c, job_id, "restore_end") if e.attempt == 1 and e.source == "rank:0"]
            assert restore.step == 20
            # keep = 2: the newest two, committed and whole; the torn and the older ones gone.
            folder = Path(job["attempts"][1]["resume_from"]).parent
            assert sorted(p.name for p in folder.iterdir()) == ["accelerate-00000030", "accelerate-00000040"]
            assert all(verify(p) is None for p in folder.iterdir())

            # A cancel: SIGTERM to both ranks; they agree on the step, save it and stop.
            cancelled = c.submit(**endless)
            wait_for(lambda: [e for e in events(c, cancelled, "step") if e.step >= 3], 120, "a third step")
            assert c.user.post(f"/api/v1/jobs/{cancelled}/cancel").json()["state"] == "cancelled"
            ends = wait_for(lambda: len(e := events(c, cancelled, "train_end")) == 2 and e, 60, "both ranks' ends")
            assert {e.source for e in ends} == {"rank:0", "rank:1"} and ends[0].step == ends[1].step, ends
            stop = ends[0].step
            [committed] = [e for e in events(c, cancelled, "ckpt_committed") if e.step == stop]
            assert (Path(committed.data["path"]) / MARKER).exists() and verify(Path(committed.data["path"])) is None
            assert Path(committed.data["path"]).name == f"accelerate-{stop:08d}"
            assert c.wait_job(cancelled)["attempts"][0]["state"] == "stopped", c.logs()
        uninterrupted.result()
    assert_same_parameters(plain, as_job)
