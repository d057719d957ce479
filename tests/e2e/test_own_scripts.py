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
    newest_committed_before_the_failure,
)
from tests.support.processes import pids_with_env

pytestmark = pytest.mark.slow

KILL = {"attempt": 0, "rank": 1, "at_step": 13, "action": "kill"}


def plain_torchrun(script: str, *args: str, ranks: int = 2) -> None:
    """The script under plain torchrun on one node with `ranks` ranks: no ETT variable set. Output
    goes to files, not pipes: a rank left behind must not keep the test waiting for their end."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(REPO / "examples" / script), *args]
    marker = uuid.uuid4().hex  # on torchrun and its ranks (each in a session of its own)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETT_")} | {"OWN_SCRIPT_RUN": marker}
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


def run_with_a_kill(c: Cluster, spec: dict, **agent: Any) -> dict:
    """Starts two agents (`agent`: Cluster.start_agent's arguments), submits the job with rank 1
    SIGKILLed at step 13 of attempt 0; checks the recovery."""
    c.start_agent("node-a", **agent), c.start_agent("node-b", **agent)
    job_id = c.submit(**spec, faults=[KILL])
    job = c.wait_job(job_id, timeout=300)
    assert job["state"] == "succeeded", c.logs()
    first, second = job["attempts"]
    assert first["cause"] == "signal" and second["state"] == "succeeded"
    # A successful attempt's ranks leave nothing behind (DCP's checkpoint process included).
    assert f"attempt {job_id}/1: killed" not in c.logs()

    # The second attempt restored the newest checkpoint committed before the failure.
    newest = newest_committed_before_the_failure(c, job_id)
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
