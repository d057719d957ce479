"""Nodes scored across jobs (service/agents/nodes.py): a node whose ranks were stragglers in two
jobs or more is named slow in the nodes API and `ett nodes`; one job's flags alone, or a rank that
was slow on every node it ran on (its slowness follows it), name none."""

import subprocess
import sys
from datetime import UTC, datetime

import pytest

from service.models import StragglerFlag
from tests.service.factories import register_agent, submit


def flag(job_id: str, rank: int, node: str, attempt: int = 0) -> StragglerFlag:
    return StragglerFlag(job_id=job_id, attempt=attempt, rank=rank, node=node, since_step=15, flagged_step=25,
                         relative=3.0, work_seconds=0.3, peer_seconds=0.1, flagged_at=datetime.now(UTC))


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_node_slow_in_two_jobs_is_named_one_slow_in_one_or_for_a_rank_is_not(service):
    admin = service.client(service.token("admin"))
    for name in ("node-x", "node-y", "node-z", "node-w"):
        register_agent(service.client(service.token("agent", name)), name)
    user = service.client(service.token("user", "alice"))
    one, two, three = (submit(user, name=f"job-{i}")["id"] for i in range(3))
    with service.context.sessions() as session:
        session.add_all([flag(one, 1, "node-x"), flag(two, 0, "node-x"),  # node-x: two jobs
                         flag(one, 0, "node-y"), flag(one, 0, "node-y", attempt=1),  # node-y: one job, twice
                         flag(three, 1, "node-z"), flag(three, 1, "node-w", attempt=1),  # the rank's slowness
                         flag(two, 1, "node-z")])  # fmt: skip
        session.commit()
    nodes = {n["name"]: n for n in admin.get("/api/v1/nodes").json()}
    assert {name: (n["flags"], n["slow_in_jobs"]) for name, n in nodes.items()} == {
        "node-x": (2, 2), "node-y": (2, 1), "node-z": (2, 1), "node-w": (1, 0)}
    assert nodes["node-x"]["slow"].startswith("slow in 2 jobs: their ranks on it were stragglers")
    assert [name for name, n in nodes.items() if n["slow"]] == ["node-x"]
    env = {"PATH": "/usr/bin:/bin", "ETT_SERVICE_URL": service.url, "ETT_TOKEN": service.token("admin")}
    listed = subprocess.run([sys.executable, "-m", "ett_cli.main", "nodes"], env=env, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    named = [i for i, line in enumerate(lines) if line.strip().startswith("slow in")]
    assert [lines[i - 1].split()[0] for i in named] == ["node-x"], listed.stdout
