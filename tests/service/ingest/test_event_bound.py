"""A job's bound on the events it stores (issue 48): a job that sends more than
ETT_MAX_EVENTS_PER_RANK a rank has none stored past it, is stopped with the bound and its setting
for reason (the job API, `ett report`, a stop command to its agent), and its agent's forwarder takes
the answer (`refused`) as delivered: nothing sent again, nothing set aside. Another job on the same
node, in the same batches, is stored all the same."""

import json
import time

import pytest
from sqlalchemy import func, select

from agent.client import ServiceClient
from agent.forwarding.forward import Forwarder
from agent.node.metrics import AgentStats
from agent.settings import AgentSettings
from ett.protocol import EVENTS_DIR, rank_spool
from service.models import JobEvent
from service.settings import Settings
from tests.service.factories import give_attempt, register_agent, submit
from tests.service.api.test_client_cli import ett

PER_RANK = 5  # x 2 ranks: a bound of 10 events a job


@pytest.fixture
def settings(database_url, tmp_path) -> Settings:
    return Settings(database_url=database_url, data_dir=tmp_path / "data", max_events_per_rank=PER_RANK)


def step(seq: int, source: str = "rank:0") -> dict:
    return {"kind": "step", "ts": time.time() - 60 + seq * 0.01, "attempt": 0, "source": source, "seq": seq,
            "step": seq, "data": {"duration": 0.01}}  # fmt: skip


def spool(root, job_id: str, rank: int, events: list[dict]) -> None:
    path = root / job_id / "0" / EVENTS_DIR / rank_spool(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def stored_by_ranks(service, job_id: str) -> list[int]:
    with service.context.sessions() as session:
        return list(session.scalars(select(JobEvent.seq).where(JobEvent.job_id == job_id,
                                                               JobEvent.source != "service").order_by(JobEvent.seq)))


def two_running_jobs(service) -> tuple:
    """Alice's two jobs of 2 nodes x 1 rank, their attempts 0 on node-a (the one node: the scheduler
    cannot place them, and leaves them to the test)."""
    alice_token, agent_token = service.token("user", "alice"), service.token("agent", "node-a")
    alice, agent = service.client(alice_token), service.client(agent_token)
    register_agent(agent, "node-a", slots=4)
    jobs = [submit(alice, name=name, nodes=2, procs_per_node=1)["id"] for name in ("noisy", "quiet")]
    for job_id in jobs:
        give_attempt(service, job_id, "node-a")
    return alice_token, agent_token, agent, *jobs


def test_a_job_past_its_bound_is_stopped_with_why_and_its_agent_sends_nothing_again(service, tmp_path):
    alice_token, agent_token, agent, noisy, quiet = two_running_jobs(service)
    root = tmp_path / "agent"
    client = ServiceClient(AgentSettings(service_url=service.url, token=agent_token, name="node-a", data_dir=root))
    answers = []

    def post(events: list[dict]):
        response = client.post_events(events)
        answers.append(response.json())
        return response

    forwarder = Forwarder(root / "spool", root, post, AgentStats())
    spool(root / "spool", noisy, 0, [step(i) for i in range(25)])
    spool(root / "spool", quiet, 1, [step(i, "rank:1") for i in range(4)])
    assert forwarder.forward_once(flush=True)

    # One batch of both jobs: the quiet job's 4 and the noisy job's first 10 stored, its 15 more refused.
    assert answers == [{"accepted": 14, "duplicates": 0, "refused": 15}]
    assert stored_by_ranks(service, noisy) == list(range(10)) and stored_by_ranks(service, quiet) == list(range(4))
    # Taken as delivered: not sent again, not set aside, the spool read to its end.
    assert forwarder.forward_once(flush=True) and len(answers) == 1
    assert forwarder.stats.dead_letters == 0 and forwarder.stats.forward_failures == 0
    assert not (root / "dead-letters.jsonl").exists()
    offsets = json.loads((root / "forward-offsets.json").read_text())
    assert offsets[f"{noisy}/0/{EVENTS_DIR}/{rank_spool(0)}"] == (root / "spool" / noisy / "0" / EVENTS_DIR
                                                                 / rank_spool(0)).stat().st_size  # fmt: skip

    # Stopped, and told why: the job API, its agent's next heartbeat, `ett report`.
    alice = service.client(alice_token)
    job = alice.get(f"/api/v1/jobs/{noisy}").json()
    why = "more events than its bound of 10 (ETT_MAX_EVENTS_PER_RANK 5 x 2 ranks)"
    assert job["state"] == "failed" and why in job["reason"], job
    [attempt] = job["attempts"]
    assert attempt["state"] == "failed" and attempt["cause"] == "event_limit" and why in attempt["detail"], attempt
    beat = agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time()}).json()
    assert [(c["type"], c["job_id"], c["attempt"]) for c in beat["commands"]] == [("stop", noisy, 0)]
    report = ett("report", noisy, service=service.url, token=alice_token)
    assert report.returncode == 0 and "attempt 0: event_limit" in report.stdout and why in report.stdout, report

    # The noisy job's rank goes on until its agent stops it: refused, not stored, not sent again.
    spool(root / "spool", noisy, 0, [step(i) for i in range(25, 30)])
    spool(root / "spool", quiet, 1, [step(i, "rank:1") for i in range(4, 7)])
    assert forwarder.forward_once(flush=True)
    assert answers[1:] == [{"accepted": 3, "duplicates": 0, "refused": 5}]
    assert stored_by_ranks(service, noisy) == list(range(10)) and stored_by_ranks(service, quiet) == list(range(7))
    assert alice.get(f"/api/v1/jobs/{quiet}").json()["state"] == "running"
    assert forwarder.stats.dead_letters == 0


def test_a_batch_sent_again_at_the_bound_is_repeats_not_refused_and_an_admins_replay_is_bounded(service):
    """The agent sends a batch again when its answer was lost: at the bound, its events are repeats
    (no new rows), not events past it, and the job runs on. The admin's replay is bounded as well."""
    _, _, agent, noisy, quiet = two_running_jobs(service)
    batch = [step(i) | {"job_id": noisy} for i in range(10)]
    for answer in ({"accepted": 10, "duplicates": 0, "refused": 0}, {"accepted": 0, "duplicates": 10, "refused": 0}):
        assert agent.post("/api/v1/agents/node-a/events", json={"events": batch}).json() == answer
    assert service.client(service.token("user", "alice")).get(f"/api/v1/jobs/{noisy}").json()["state"] == "running"

    admin = service.client(service.token("admin"))
    replayed = admin.post(f"/api/v1/jobs/{quiet}/events", json={"events": [step(i) for i in range(12)]})
    assert replayed.json() == {"accepted": 10, "duplicates": 0, "refused": 2}
    assert stored_by_ranks(service, quiet) == list(range(10))
    job = admin.get(f"/api/v1/jobs/{quiet}").json()
    assert job["state"] == "failed" and job["attempts"][0]["cause"] == "event_limit"
    with service.context.sessions() as session:  # the service's own events of the stop are stored past it
        kinds = session.scalars(select(JobEvent.kind).where(JobEvent.job_id == quiet, JobEvent.source == "service"))
        assert sorted(kinds) == ["attempt_failed", "job_finished"]
        assert session.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == quiet)) == 12
