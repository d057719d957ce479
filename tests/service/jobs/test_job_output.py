"""What a job writes reaches the service as hostile input (issue 48): the rank numbers its log files
and events name are bounded by its attempt's world, and a failure is diagnosed from its rank's
output through torch's line prefixes, in linear time, with no write transaction open. The patterns
themselves: tests/service/jobs/test_diagnosis.py; the same output on the pages: tests/service/api/test_pages.py."""

import sqlite3
import time

import pytest
from sqlalchemy import func, select

from service.failures import diagnosis
from service.models import JobEvent
from tests.service.factories import give_attempt, register_agent, report_failure, submit

SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
TRACEBACK = ["Traceback (most recent call last):", '  File "/work/train.py", line 41, in <module>',
             "    raise ValueError('bad batch')", "ValueError: bad batch"]  # fmt: skip


def running_job(service):
    """Alice's job of 8 nodes x 2 ranks (16), its attempt 0 on node-a: the one node registered, so
    the scheduler leaves the job to the test."""
    alice = service.client(service.token("user", "alice"))
    job = submit(alice, nodes=8, procs_per_node=2)
    agent = service.client(service.token("agent", "node-a"))
    register_agent(agent, "node-a")
    give_attempt(service, job["id"], "node-a")
    return alice, agent, job["id"]


def test_log_pieces_and_events_of_a_rank_beyond_the_attempts_world_are_refused_and_nothing_is_stored(service):
    alice, agent, job_id = running_job(service)
    piece = {"job_id": job_id, "attempt": 0, "rank": 0, "text": "step 1\n", "skipped": 0}
    for rank in (999999, 16):
        refused = agent.post("/api/v1/agents/node-a/logs", json={"logs": [piece, piece | {"rank": rank}]})
        assert refused.status_code == 422, refused.text
        [problem] = refused.json()["detail"]
        assert problem["field"] == "logs.1.rank" and problem["msg"].startswith(f"rank {rank} does not exist")
        assert "its ranks are 0 to 15" in problem["msg"]
    assert alice.get(f"/api/v1/jobs/{job_id}/logs").json()["ranks"] == []  # nor the good piece beside it
    assert agent.post("/api/v1/agents/node-a/logs", json={"logs": [piece | {"rank": 15}]}).status_code == 200
    assert alice.get(f"/api/v1/jobs/{job_id}/logs").json()["ranks"] == [15]

    event = {"job_id": job_id, "kind": "init_start", "ts": time.time() - 1, "attempt": 0, "source": "rank:0",
             "seq": 1, "data": {"pid": 1}}  # fmt: skip
    for source in ("rank:999999", "rank:16"):
        refused = agent.post("/api/v1/agents/node-a/events", json={"events": [event, event | {"source": source}]})
        assert refused.status_code == 422, refused.text
        [problem] = refused.json()["detail"]
        assert problem["field"] == "events.1.source" and problem["msg"].startswith(f"{source} does not exist")
    with service.context.sessions() as session:
        assert session.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == job_id)) == 0
    accepted = agent.post("/api/v1/agents/node-a/events", json={"events": [event | {"source": "rank:15"}]})
    assert accepted.json() == {"accepted": 1, "duplicates": 0, "refused": 0}


@SQLITE_ONLY
@pytest.mark.timeout(60)  # the old patterns took minutes on the last line, inside the heartbeat's transaction
def test_a_failure_is_diagnosed_through_torchs_prefixes_with_no_write_transaction_open(service, settings, monkeypatch):
    alice, agent, job_id = running_job(service)
    # The traceback as torch.distributed prints it after init_process_group, then a line of 250 Ki
    # characters without a newline.
    text = "".join(f"[rank0]: {line}\n" for line in TRACEBACK) + "NCCL " * (50 << 10)
    shipped = agent.post("/api/v1/agents/node-a/logs",
                         json={"logs": [{"job_id": job_id, "attempt": 0, "rank": 0, "text": text, "skipped": 0}]})
    assert shipped.status_code == 200, shipped.text
    database, write_lock_held = settings.database_url.removeprefix("sqlite:///"), []
    scan = diagnosis.read_lines

    def read_lines(lines, patterns):
        # SQLite has one writer: were the lines read inside the heartbeat's write transaction (this
        # thread's), its lock would not come free in the 5 s this waits.
        probe = sqlite3.connect(database, timeout=5, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            write_lock_held.append(False)
        except sqlite3.OperationalError:
            write_lock_held.append(True)
        finally:
            probe.close()
        return scan(lines, patterns)

    monkeypatch.setattr(diagnosis, "read_lines", read_lines)
    assert report_failure(agent, "node-a", job_id, "rank 0 exit code 1").status_code == 200
    assert write_lock_held == [False]
    [attempt] = alice.get(f"/api/v1/jobs/{job_id}").json()["attempts"]
    assert attempt["state"] == "failed"
    assert (attempt["diagnosis"], attempt["summary"]) == ("exception", "ValueError: bad batch")
