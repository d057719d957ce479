"""ETT jobs on a real Slurm cluster (tests/support/slurm.py): each job in an allocation of its
own, restarted inside it, released at its end, moved off a lost node, stopped cleanly by Slurm."""

import json
import os
import signal
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from service.models import Node, NodeState, SlurmAllocation, Token
from tests.slurm.conftest import slurm_job
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
PLAIN_DDP = Path(__file__).parents[2] / "examples" / "plain_ddp.py"


def running_attempt(ett, job_id: str) -> dict:
    def running():
        job = ett.job(job_id)
        return job if job["attempts"] and job["attempts"][-1]["state"] == "running" else None
    return wait_for(running, 90, f"job {job_id} to run")


def slurm_time(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()  # scontrol prints the local time


def test_a_job_runs_in_its_own_allocation_restarts_there_and_releases_it(ett, slurm, python):
    kill = {"attempt": 0, "rank": 1, "at_step": 5, "action": "kill"}
    job_id = ett.submit(slurm_job(python, "on-slurm", nodes=2, steps=20, faults=[kill]))
    job = ett.wait_job(job_id, 180)
    assert job["state"] == "succeeded", (job, ett.logs())
    assert [a["cause"] for a in job["attempts"]] == ["signal", None]
    slurm_id = job["slurm"]["job_id"]
    assert job["slurm"]["nodes"] == ["n1", "n2"] and job["slurm"]["allocation"] == 0
    # Both attempts ran on the allocation's two agents, and their events say so in Slurm's terms.
    assert all(a["nodes"] == [f"slurm-{slurm_id}-n1", f"slurm-{slurm_id}-n2"] for a in job["attempts"])
    allocated = ett.events(job_id, kind="attempt_allocated")
    assert [(e.data["slurm_job_id"], e.data["slurm_nodes"]) for e in allocated] == [(slurm_id, ["n1", "n2"])] * 2
    # Released at the end: cancelled in Slurm, its agents out, its token revoked once their last
    # events had the stop grace to arrive.
    wait_for(lambda: slurm.job(slurm_id)["JobState"] == "CANCELLED", 30, "the allocation to be released")
    with ett.sessions() as session:
        states = session.scalars(select(Node.state).where(Node.job_id == job_id)).all()
        assert len(states) == 2 and set(states) <= {NodeState.lost, NodeState.leaving}, states

    def revoked() -> bool:
        with ett.sessions() as session:
            allocation = session.scalar(select(SlurmAllocation).where(SlurmAllocation.job_id == job_id))
            return session.get(Token, allocation.token_id).revoked
    wait_for(revoked, 30, "the allocation's token to be revoked")
    # The job's page says where it runs in Slurm's terms.
    with httpx.Client(base_url=ett.url, follow_redirects=True) as browser:
        page = browser.get(f"/jobs/{job_id}", params={"token": ett.token("user", "alice")}).text
    assert f'data-slurm="job_id">{slurm_id}<' in page and '"nodes">n1, n2<' in page, page
    # Slurm's queue time is in the report's queued_seconds (which also holds the agents' start).
    fields = slurm.job(slurm_id)
    in_slurm_queue = slurm_time(fields["StartTime"]) - slurm_time(fields["SubmitTime"])
    assert ett.report(job_id)["queued_seconds"] >= in_slurm_queue - 1.0


def test_a_job_waits_in_slurms_queue_with_slurms_reason_and_cancelling_it_releases_it(ett, slurm, python):
    # Both nodes held by a job outside ETT: the ETT job waits in Slurm's queue, and says why.
    blocker = slurm.run("sbatch", "--parsable", "--partition=batch", "--nodes=2", "--output=/dev/null",
                        "--wrap=sleep 600").strip()  # fmt: skip
    wait_for(lambda: slurm.job(blocker)["JobState"] == "RUNNING", 60, "the blocking job to run")
    job_id = ett.submit(slurm_job(python, "cancel-me", nodes=1, steps=100000))
    waiting = wait_for(lambda: "waiting in Slurm's queue" in ((j := ett.job(job_id))["reason"] or "") and j, 30,
                       "the job to wait in Slurm's queue")  # fmt: skip
    assert waiting["state"] == "queued" and waiting["slurm"]["state"] == "PENDING", waiting
    slurm.run("scancel", blocker)
    running_attempt(ett, job_id)
    slurm_id = ett.job(job_id)["slurm"]["job_id"]
    with ett.client("user") as client:
        assert client.post(f"/api/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    wait_for(lambda: slurm.job(slurm_id)["JobState"] == "CANCELLED", 30, "the allocation to be cancelled")


def test_an_agent_that_vanishes_costs_its_node_and_the_job_goes_on_without_it(ett, slurm, python):
    job_id = ett.submit(slurm_job(python, "lose-node", nodes=1, steps=60, step_seconds=0.1))
    job = running_attempt(ett, job_id)
    first, node = job["slurm"]["job_id"], job["slurm"]["nodes"][0]
    agent = next(pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).count(f"slurm-{first}-{node}"))
    os.kill(int(agent), signal.SIGKILL)  # as a crashed node would: no goodbye
    job = ett.wait_job(job_id, 180)
    assert job["state"] == "succeeded", (job, ett.logs())
    assert job["attempts"][0]["cause"] == "node_lost" and node in job["attempts"][0]["detail"]
    other = {"n1": "n2", "n2": "n1"}[node]
    assert job["slurm"]["allocation"] == 1 and job["slurm"]["nodes"] == [other]
    assert slurm.job(job["slurm"]["job_id"])["ExcNodeList"] == node  # asked Slurm for a node but that one


def test_a_silent_agent_is_lost_its_allocation_replaced_and_without_a_spare_node_slurm_takes_any(ett, slurm,
                                                                                              python):
    job_id = ett.submit(slurm_job(python, "silent-node", nodes=2, steps=80, step_seconds=0.1))
    job = running_attempt(ett, job_id)
    first = job["slurm"]["job_id"]
    agent = next(pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).count(f"slurm-{first}-n2"))
    os.kill(int(agent), signal.SIGSTOP)  # alive to Slurm, silent to ETT: lost after the heartbeat timeout
    job = ett.wait_job(job_id, 180)
    assert job["state"] == "succeeded", (job, ett.logs())
    assert job["attempts"][0]["cause"] == "node_lost", job["attempts"][0]
    with ett.sessions() as session:
        allocations = session.scalars(select(SlurmAllocation).where(SlurmAllocation.job_id == job_id)
                                      .order_by(SlurmAllocation.number)).all()  # fmt: skip
        assert [a.bad_nodes for a in allocations] == [["n2"], []]
    # Both nodes are needed and one is left out: sbatch refuses --exclude=n2, so Slurm picks any.
    assert job["slurm"]["allocation"] == 1 and job["slurm"]["nodes"] == ["n1", "n2"]
    assert slurm.job(first)["JobState"] == "CANCELLED"


@pytest.mark.over_budget("a real Slurm preemption and a second allocation")
def test_a_preempted_job_saves_a_final_checkpoint_in_the_grace_and_goes_on_in_a_new_allocation(ett, slurm, python):
    spec = {"name": "preempted", "nodes": 2, "procs_per_node": 1, "max_restarts": 2,
            "entrypoint": [str(python), str(PLAIN_DDP), "--steps", "40", "--step-seconds", "0.2"],
            "checkpoint": {"interval_steps": 1000}, "slurm": {"partition": "batch"}}  # fmt: skip
    job_id = ett.submit(spec)
    wait_for(lambda: len(ett.events(job_id, kind="step", attempt=0)) >= 5, 120, "five steps")
    # A job of a higher partition takes a node: Slurm preempts ours (SIGTERM, SIGKILL after KillWait).
    slurm.run("sbatch", "--partition=urgent", "--nodes=1", "--exclusive", "--output=/dev/null", "--wrap=sleep 3")
    job = ett.wait_job(job_id, 240)
    assert job["state"] == "succeeded", (job, ett.logs())
    first = job["attempts"][0]
    assert first["cause"] == "preempted" and "PREEMPTED" in first["detail"], first
    # The ranks finished their step, saved it and exited: nothing after the final checkpoint was lost.
    committed = [e.step for e in ett.events(job_id, kind="ckpt_committed", attempt=0)]
    last_step = max(e.step for e in ett.events(job_id, kind="step", attempt=0))
    assert committed == [last_step], (committed, last_step)
    assert job["attempts"][1]["resume_from"].endswith(f"step-{last_step:08d}")
    assert job["slurm"]["allocation"] == 1
    failure = ett.report(job_id)["failures"][0]
    assert failure["cause"] == "preempted" and failure["lost_steps"] == 0, failure


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_the_services_environment_does_not_reach_the_ranks(ett, python):
    """The allocation is submitted with --export=NONE: the service's environment (its database
    URL, which may hold a password, among it) is not the agents' nor the ranks'."""
    dump = "import json, os; json.dump(dict(os.environ), open(os.environ['ETT_CHECKPOINT_DIR'] + '/env.json', 'w'))"
    spec = {"name": "env", "nodes": 1, "procs_per_node": 1, "max_restarts": 0,
            "entrypoint": [str(python), "-c", dump], "slurm": {"partition": "batch", "time_limit": "10"}}
    job = ett.wait_job(ett.submit(spec), 180)
    assert job["state"] == "succeeded", (job, ett.logs())
    env = json.loads((ett.checkpoint_area() / job["id"] / "env.json").read_text())
    assert env["ETT_JOB_ID"] == job["id"]  # the job's own, from the agent
    assert not {"ETT_DATABASE_URL", "ETT_CHECKPOINT_ROOT", "ETT_DATA_DIR"} & env.keys(), sorted(env)
