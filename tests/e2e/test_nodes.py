"""Nodes for operators, with real agents: a node whose health check fails gets no launch and the
job runs elsewhere; a node is drained only by node evidence, never by its jobs: ranks that kill
themselves, or a real job that prints "Xid 79" and "No space left on device" and exits 1 five
times, drain nothing, and the next job on that node succeeds; a health check that fails again and
again drains the node with that evidence shown (`ett nodes`) until an admin returns it, and the
job waiting for it then runs. Which evidence counts, rule by rule: tests/service/jobs/test_node_evidence.py;
the kernel's records: tests/agent/forwarding/test_kernel_log.py."""

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
# What a job may print about the hardware: its own words, which count against no node.
XID_AND_FULL_DISK = """
import sys
print("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.", flush=True)
print("OSError: [Errno 28] No space left on device", file=sys.stderr, flush=True)
sys.exit(1)
"""


def fake_job(name: str, steps: int, **spec) -> dict:
    return {"name": name, "nodes": 1, "procs_per_node": 1, "max_restarts": 0,
            "entrypoint": [sys.executable, str(FAKE_RANK), "--steps", str(steps), "--step-seconds", "0.05"]} | spec


def ett_nodes(c, *args: str) -> str:
    env = os.environ | {"ETT_SERVICE_URL": c.service.url, "ETT_TOKEN": c.service.token("admin")}
    return subprocess.run([ETT, "nodes", *args], env=env, capture_output=True, text=True, check=True, timeout=60).stdout


def node(c, name: str) -> dict:
    return next(n for n in c.admin.get("/api/v1/nodes").json() if n["name"] == name)


def of_this_test(node: dict) -> list[dict]:
    """The node's evidence but for the machine's out-of-memory kills: the test's agents share one kernel
    with the suite's other tests, whose real kills under an operator's cap every agent here reads too."""
    return [e for e in node["evidence"] if e["kind"] != "oom_kill"]


def test_an_unhealthy_node_gets_no_launch_and_only_node_evidence_drains_one_until_returned(tmp_path):
    flag = tmp_path / "gpu-fault"  # while it exists, node-ok's health check fails: the test's stand-in for a fault
    with cluster(tmp_path, node_failure_limit=3) as c:
        c.start_agent("node-sick", slots=1, health_check=SICK)
        c.start_agent("node-ok", slots=1, health_check=f"sh -c 'test ! -e {flag} || {{ echo Xid 79 >&2; exit 1; }}'",
                      health_check_interval_seconds="0.2")
        healthy = c.wait_job(c.submit(**fake_job("healthy", 3)))
        assert healthy["state"] == "succeeded" and healthy["attempts"][0]["nodes"] == ["node-ok"]
        listing = ett_nodes(c)
        assert "GPU 3 fell off the bus" in next(line for line in listing.splitlines() if line.startswith("node-sick"))

        # Ranks that kill themselves (the agent's `kill` fault) fail on node-ok three times: the job's doing.
        kills = [{"attempt": a, "rank": 0, "at_step": 3, "action": "kill"} for a in (0, 1, 2)]
        failing = c.wait_job(c.submit(**fake_job("failing", 50, faults=kills, max_restarts=2)))
        assert [a["cause"] for a in failing["attempts"]] == ["signal"] * 3, failing
        ok = node(c, "node-ok")
        assert (ok["failures"], ok["drained"], of_this_test(ok)) == (3, None, []), ok

        for _ in range(3):  # node-ok's own check fails, passes, fails...: node evidence, three times
            flag.touch()
            wait_for(lambda: node(c, "node-ok")["health"], 30, "node-ok's check to fail")
            flag.unlink()
            wait_for(lambda: node(c, "node-ok")["health"] is None, 30, "node-ok's check to pass")
        ok = node(c, "node-ok")
        assert "of node evidence within 3600 s: health_check (the agent's health check)" in ok["drained"], ok
        shown = [line.strip() for line in ett_nodes(c).splitlines() if "health_check from" in line]
        assert any(line.endswith("health_check from the agent's health check: health check `sh -c 'test ! -e "
                                 f"{flag} || {{ echo Xid 79 >&2; exit 1; }}'` failed: exit code 1: Xid 79 [drained it]")
                   for line in shown), shown

        waiting = c.submit(**fake_job("waiting", 3))
        wait_for(lambda: c.job(waiting)["reason"], 30, "the job to say why it waits")
        assert c.job(waiting)["state"] == "queued"
        assert ett_nodes(c, "return", "node-ok").strip() == "node-ok: returned: it takes new work"
        assert c.wait_job(waiting)["state"] == "succeeded"
        drained = ett_nodes(c, "drain", "node-ok", "--reason", "disk replacement")
        assert drained.strip() == "node-ok: drained by admin: disk replacement"


def test_a_job_printing_xid_79_and_a_full_disk_and_exiting_1_five_times_drains_nothing(tmp_path):
    with cluster(tmp_path) as c:  # node_failure_limit: 3 (the suite's other tests make 2 real kills at most)
        c.start_agent("node-a", slots=1)
        loud = c.wait_job(c.submit(name="xid", nodes=1, procs_per_node=1, hang_timeout_seconds=None,
                                   entrypoint=[sys.executable, "-c", XID_AND_FULL_DISK], max_restarts=4,
                                   max_same_failures=5))
        assert loud["state"] == "failed" and len(loud["attempts"]) == 5, loud
        # The job's report says what it printed; the node is not condemned for it.
        assert {(a["diagnosis"], a["summary"]) for a in loud["attempts"]} == {
            ("hardware_error", "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.")}
        seen = node(c, "node-a")
        assert seen["drained"] is None and seen["failures"] == 5, seen
        assert of_this_test(seen) == [], seen  # the job's stdout never reaches the kernel's log
        after = c.wait_job(c.submit(**fake_job("after", 3)))
        assert after["state"] == "succeeded" and after["attempts"][0]["nodes"] == ["node-a"], after
