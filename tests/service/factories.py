"""Small factories for request bodies and rows used across the service tests."""

import time
from typing import Any

import httpx


def job_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "moe-test",
        "nodes": 2,
        "procs_per_node": 2,
        "trainer": {"preset": "tiny", "overrides": {"moe.num_experts": 4, "parallel.zero": 3}},
        "max_restarts": 2,
        "no_retry_exit_codes": [],
        "max_same_failures": 3,
        "stragglers": "report",
        "checkpoint": {"interval_steps": 5, "keep": 2, "dir": None, "snapshots": False, "snapshot_copies": 1},
        "hang_timeout_seconds": 30,
        "faults": [],
        "env": {},
        "entrypoint": None,
        "slurm": None,
        "notify": None,
        "warm_imports": [],
        "elastic": None,
    }
    spec.update(overrides)
    return spec


def submit(client: httpx.Client, **overrides: Any) -> dict[str, Any]:
    response = client.post("/api/v1/jobs", json=job_spec(**overrides))
    assert response.status_code == 201, response.text
    return response.json()


def register_agent(client: httpx.Client, name: str = "node-a", slots: int = 2) -> dict[str, Any]:
    response = client.post("/api/v1/agents/register", json={"name": name, "address": "127.0.0.1", "slots": slots})
    assert response.status_code == 200, response.text
    return response.json()


def give_attempt(service, job_id: str, node_name: str, attempt: int = 0) -> None:
    """Records that the node runs the job's attempt, as the scheduler would but without its events:
    an agent may report events only for attempts given to its node. The job is running from then
    on, so the live service's own scheduler gives it no other attempt meanwhile."""
    from sqlalchemy import select

    from service.models import Attempt, AttemptNode, Job, JobState, Node

    with service.context.sessions() as session:
        node = session.scalar(select(Node).where(Node.name == node_name))
        row = Attempt(job_id=job_id, number=attempt, master_addr=node.address, master_port=29500)
        row.nodes.append(AttemptNode(node=node, node_rank=0))
        session.add(row)
        session.get(Job, job_id).state = JobState.running
        session.commit()


def report_failure(agent: httpx.Client, node_name: str, job_id: str, detail: str, attempt: int = 0) -> httpx.Response:
    """A heartbeat of the node saying that its share of the attempt failed, as its agent sends one."""
    report = {"job_id": job_id, "attempt": attempt, "state": "failed", "cause": "exit", "detail": detail, "exit_code": 1}
    return agent.post(f"/api/v1/agents/{node_name}/heartbeat", json={"clock": time.time(), "attempts": [report]})
