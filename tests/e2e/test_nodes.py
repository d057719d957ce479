"""Nodes for operators, with real agents: a node whose health check fails gets no launch and the
job runs elsewhere; a node whose ranks fail again and again is drained until an admin returns it
(`ett nodes`, `ett nodes return`), and the job waiting for it then runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.helpers import FAKE_RANK
from tests.support.cluster import cluster
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow
ETT = str(Path(sys.executable).parent / "ett")
SICK = "sh -c 'echo GPU 3 fell off the bus >&2; exit 1'"


def fake_job(name: str, steps: int, **spec) -> dict:
    return {"name": name, "nodes": 1, "procs_per_node": 1, "max_restarts": 0,
            "entrypoint": [sys.executable, str(FAKE_RANK), "--steps", str(steps), "--step-seconds", "0.05"]} | spec


def ett_nodes(c, *args: str) -> str:
    env = os.environ | {"ETT_SERVICE_URL": c.service.url, "ETT_TOKEN": c.service.token("admin")}
    return subprocess.run([ETT, "nodes", *args], env=env, capture_output=True, text=True, check=True, timeout=60).stdout


def test_an_unhealthy_node_gets_no_launch_and_a_failing_one_is_drained_until_returned(tmp_path):
    with cluster(tmp_path, node_failure_limit=2) as c:
        c.start_agent("node-sick", slots=1, health_check=SICK)
        c.start_agent("node-ok", slots=1)
        healthy = c.wait_job(c.submit(**fake_job("healthy", 3)))
        assert healthy["state"] == "succeeded" and healthy["attempts"][0]["nodes"] == ["node-ok"]
        listing = ett_nodes(c)
        assert "GPU 3 fell off the bus" in next(line for line in listing.splitlines() if line.startswith("node-sick"))

        kills = [{"attempt": a, "rank": 0, "at_step": 3, "action": "kill"} for a in (0, 1)]
        failing = c.wait_job(c.submit(**fake_job("failing", 50, faults=kills, max_restarts=1)))
        assert [a["cause"] for a in failing["attempts"]] == ["signal", "signal"], failing
        [ok] = [n for n in c.admin.get("/api/v1/nodes").json() if n["name"] == "node-ok"]
        assert ok["failures"] == 2 and ok["drained"].startswith("2 failures within 3600 s (signal)"), ok

        waiting = c.submit(**fake_job("waiting", 3))
        wait_for(lambda: c.job(waiting)["reason"], 30, "the job to say why it waits")
        assert c.job(waiting)["state"] == "queued"
        assert ett_nodes(c, "return", "node-ok").strip() == "node-ok: returned: it takes new work"
        assert c.wait_job(waiting)["state"] == "succeeded"
        drained = ett_nodes(c, "drain", "node-ok", "--reason", "disk replacement")
        assert drained.strip() == "node-ok: drained by admin: disk replacement"
