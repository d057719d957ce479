"""The agent process against the real service on loopback: register, heartbeats, commands, events."""

import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
from sqlalchemy import select

from service.models import JobEvent, Node
from tests.agent.helpers import FAKE_RANK
from tests.support.job_user import SUITE_USER_JOBS
from tests.support.processes import pids_with_env
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)]


@pytest.fixture
def agent(service, tmp_path):
    """`ett agent` as its own process, registered with the service under the name node-a."""
    env = os.environ | SUITE_USER_JOBS | {
        "ETT_AGENT_SERVICE_URL": service.url, "ETT_AGENT_TOKEN": service.token("agent", "node-a"),
        "ETT_AGENT_NAME": "node-a", "ETT_AGENT_SLOTS": "2", "ETT_AGENT_DATA_DIR": str(tmp_path / "agent"),
        "ETT_AGENT_HEARTBEAT_INTERVAL_SECONDS": "1", "ETT_AGENT_HEARTBEAT_WAIT_SECONDS": "1",
        "ETT_AGENT_BATCH_MAX_AGE_SECONDS": "0.1", "ETT_AGENT_STOP_GRACE_SECONDS": "2",
        "ETT_AGENT_WARM_START": "false",  # fake ranks only: no trainer to keep warm
    }  # fmt: skip
    process = subprocess.Popen([sys.executable, "-m", "agent.cli"], env=env)
    try:
        wait_for(lambda: node(service) is not None, 60, "the agent to register")
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def node(service):
    with service.context.sessions() as session:
        return session.scalar(select(Node).where(Node.name == "node-a"))


def stored_events(service, job_id):
    with service.context.sessions() as session:
        return session.scalars(select(JobEvent).where(JobEvent.job_id == job_id)).all()


def submit(service, **spec):
    with service.client(service.token("user", "alice")) as client:
        response = client.post("/api/v1/jobs", json={"name": "fake", "nodes": 1, "procs_per_node": 2} | spec)
        assert response.status_code == 201, response.text
        return response.json()["id"]


def job(service, job_id):
    with service.client(service.token("admin")) as client:
        return client.get(f"/api/v1/jobs/{job_id}").json()


def test_a_job_runs_to_success_and_every_event_is_stored_once(service, agent):
    job_id = submit(service, entrypoint=[sys.executable, str(FAKE_RANK), "--steps", "5"], max_restarts=0)

    done = wait_for(lambda: (j := job(service, job_id))["state"] != "running" and j["state"] != "queued" and j, 120,
                    "the job to end")
    assert done["state"] == "succeeded", done
    expected = {"rank:0": ["init_start", "init_end"] + ["step"] * 5 + ["train_end"],
                "rank:1": ["init_start", "init_end", "train_end"],
                "node:node-a": ["workers_launched", "worker_exited", "worker_exited"]}

    def agent_events():
        by_source = {}
        for e in sorted(stored_events(service, job_id), key=lambda e: (e.source, e.seq)):
            by_source.setdefault(e.source, []).append(e.kind)
        return {source: kinds for source, kinds in by_source.items() if source != "service"}

    wait_for(lambda: agent_events() == expected, 20, f"the events {expected}")
    beat = node(service)
    assert beat.stats["events_forwarded"] >= sum(len(kinds) for kinds in expected.values())
    assert abs(beat.clock_offset_seconds) < 1.0


def test_a_killed_rank_fails_the_attempt_and_the_restart_succeeds(service, agent):
    fault = {"attempt": 0, "rank": 1, "at_step": 3, "action": "kill"}
    job_id = submit(service, entrypoint=[sys.executable, str(FAKE_RANK), "--steps", "6", "--step-seconds", "0.2"],
                    max_restarts=1, faults=[fault])

    done = wait_for(lambda: (j := job(service, job_id))["state"] in ("succeeded", "failed") and j, 180,
                    "the job to end")
    assert done["state"] == "succeeded", done
    first, second = done["attempts"]
    assert (first["state"], first["cause"], first["detail"]) == ("failed", "signal", "rank 1 killed by SIGKILL")
    assert second["state"] == "succeeded"
    exits = [e.data for e in stored_events(service, job_id) if e.kind == "worker_exited" and e.attempt == 0]
    assert {"rank": 1, "signal": "SIGKILL"} in exits


def test_cancel_stops_the_attempt_and_no_process_is_left(service, agent):
    job_id = submit(service, entrypoint=[sys.executable, str(FAKE_RANK), "--steps", "100000"])
    wait_for(lambda: len(pids_with_env("ETT_JOB_ID", job_id)) == 6, 60, "guard, torchrun, 2 runners and 2 ranks")
    wait_for(lambda: node(service).stats.get("processes") == 2, 10, "a heartbeat counting 2 live ranks")

    with service.client(service.token("user", "alice")) as client:
        assert client.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200

    wait_for(lambda: not pids_with_env("ETT_JOB_ID", job_id), 10, "every process of the attempt to go")
    wait_for(lambda: node(service).stats.get("processes") == 0, 10, "a heartbeat counting no live rank")
    kinds = Counter(e.kind for e in stored_events(service, job_id))
    assert kinds["attempt_stopped"] == 1
    assert wait_for(lambda: Counter(e.kind for e in stored_events(service, job_id))["worker_exited"] == 2, 10,
                    "the ranks' exits to be forwarded")
