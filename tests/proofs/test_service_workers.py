"""Several service processes: `ett service --workers 2` on PostgreSQL, two agents, a job whose
first attempt fails. Both processes schedule, heartbeat and ingest; every decision is made once,
every event stored once, and the report is right."""

import re
from collections import Counter

import pytest

from tests.proofs.cluster import cluster, fake_rank_job
from tests.proofs.test_chaos import STEP_SECONDS
from tests.support.cluster import assert_categories_sum_to_wall

pytestmark = pytest.mark.slow
STEPS = 30
KILL = {"attempt": 0, "rank": 1, "at_step": 10, "action": "kill"}


def test_two_service_processes_decide_each_thing_once(tmp_path, new_database_url):
    with cluster(tmp_path, database_url=new_database_url("postgres"), workers=2) as c:
        c.start_agent("node-0"), c.start_agent("node-1")
        job_id = c.submit(fake_rank_job(nodes=2, steps=STEPS, step_seconds=STEP_SECONDS, faults=[KILL]))
        job = c.wait_job(job_id)
        events = c.events(job_id)
        report = c.report(job_id)
        service_log = (tmp_path / "service.log").read_text()
    workers = set(re.findall(r"Started server process \[(\d+)\]", service_log))
    assert len(workers) == 2, service_log[-3000:]

    # One allocation per attempt, one failure and one restart for the one fault, one end.
    assert job["state"] == "succeeded" and [a["state"] for a in job["attempts"]] == ["failed", "succeeded"]
    decisions = Counter(e.kind for e in events if e.source == "service")
    assert decisions == {"attempt_allocated": 2, "attempt_failed": 1, "job_finished": 1}, decisions
    # Every event stored once: no (attempt, source, seq) twice, and all of the last attempt's steps.
    keys = Counter((e.attempt, e.source, e.seq) for e in events)
    assert max(keys.values()) == 1
    steps = sorted(e.step for e in events if e.kind == "step" and e.attempt == 1)
    assert steps == list(range(steps[0], STEPS + 1))

    assert report["restarts"] == 1 and [f["cause"] for f in report["failures"]] == ["signal"]
    assert_categories_sum_to_wall(report)
