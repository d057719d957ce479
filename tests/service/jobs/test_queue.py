"""A queued job says why it waits: at submit (a job larger than the fleet is accepted with a
warning), in its `reason` while it waits, and its queue time stops when it is cancelled."""

import time

import pytest

from tests.service.factories import register_agent, submit
from tests.support.waiting import wait_for

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def test_a_job_larger_than_the_fleet_is_accepted_with_a_warning_and_says_why_it_waits(service):
    for name in ("node-a", "node-b"):
        register_agent(service.client(service.token("agent", name)), name, slots=2)
    user = service.client(service.token("user", "alice"))

    job = submit(user, nodes=3, procs_per_node=2)
    assert job["state"] == "queued"
    assert job["warnings"] == ["the job needs 3 nodes with 2 slots each and the fleet has 2 (2 agents registered): "
                               "it waits in the queue until enough agents register (ett agent)"]
    reason = wait_for(lambda: user.get(f"/api/v1/jobs/{job['id']}").json()["reason"], 10, "a waiting reason")
    assert reason == ("waiting for 3 nodes with 2 free slots each: the fleet has 2 (2 agents registered); "
                      "start more agents (ett agent)")

    fits = submit(user, nodes=2, procs_per_node=2)
    assert fits["warnings"] == []


def test_a_job_waiting_for_busy_nodes_says_how_many_are_free(service):
    register_agent(service.client(service.token("agent", "node-a")), "node-a", slots=2)
    user = service.client(service.token("user", "alice"))
    first = submit(user, nodes=1, procs_per_node=2)
    wait_for(lambda: user.get(f"/api/v1/jobs/{first['id']}").json()["state"] == "running", 10, "the first job to run")
    second = submit(user, nodes=1, procs_per_node=2)
    reason = wait_for(lambda: user.get(f"/api/v1/jobs/{second['id']}").json()["reason"], 10, "a waiting reason")
    assert reason == "waiting for 1 node with 2 free slots each: 0 free now, 1 in the fleet"


def test_a_cancelled_queued_jobs_queue_time_stops_at_the_cancel(service):
    user = service.client(service.token("user", "alice"))
    job = submit(user, nodes=2)  # no agents: it stays queued
    time.sleep(0.3)
    assert user.post(f"/api/v1/jobs/{job['id']}/cancel").status_code == 200
    queued = user.get(f"/api/v1/jobs/{job['id']}/ett").json()["queued_seconds"]
    time.sleep(0.5)
    assert user.get(f"/api/v1/jobs/{job['id']}/ett").json()["queued_seconds"] == queued and queued >= 0.3
