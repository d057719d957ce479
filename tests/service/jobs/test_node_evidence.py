"""Which failures count against a node (service/agents/node_evidence.py), through the real service's
heartbeats: a job's printed words, its exits, its signals and faults, its hangs never do, however
often; node evidence does (a health check that starts failing, once while it fails; a kernel record
its agent read, once however many reports carry it; its heartbeats gone, unless a job's drill took
it down), drains the node at ETT_NODE_FAILURE_LIMIT, and is shown with the drain until an admin
returns the node. With real agents and ranks: tests/e2e/test_nodes.py."""

import time

from service.settings import Settings
from tests.service.factories import give_attempt, register_agent, submit
from tests.support.live import live_service
from tests.support.waiting import wait_for

SICK = "health check `check-gpus` failed: exit code 1: GPU 3 fell off the bus"
XID_79 = {"kind": "xid", "key": "kmsg:41:123456",
          "text": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."}
# What jobs bring on themselves: (the rank's last output, the report's cause, detail, exit code).
JOBS_OWN = [
    ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus\n", "exit", "rank 0 exit code 1", 1),
    ("OSError: [Errno 28] No space left on device\n", "exit", "rank 0 exit code 1", 1),
    ("", "signal", "rank 0 killed by SIGKILL", None),  # its own kill (the `kill` fault), or os.kill
    ("", "exit", "rank 0 exit code 1 (injected fault)", 1),
    ("", "hang", "rank 0 made no progress for 3 s", None),
    ("uncorrectable ECC error encountered\n", "exit", "rank 0 exit code 1", 1),
]


def beat(agent, name: str, reports: list[dict] | None = None, health: str | None = None) -> None:
    answered = agent.post(f"/api/v1/agents/{name}/heartbeat",
                          json={"clock": time.time(), "attempts": reports or [], "health": health})
    assert answered.status_code == 200, answered.text


def failed(job_id: str, cause: str = "exit", detail: str = "rank 0 exit code 1", code: int | None = 1,
           kernel: list[dict] | None = None) -> dict:
    return {"job_id": job_id, "attempt": 0, "state": "failed", "cause": cause, "detail": detail, "exit_code": code,
            "kernel": kernel or []}


def node(admin, name: str = "node-a") -> dict:
    return next(n for n in admin.get("/api/v1/nodes").json() if n["name"] == name)


def started(service, alice, agent) -> str:
    """A job of 8 nodes given to node-a, the one node: the scheduler leaves it to the test."""
    job_id = submit(alice, nodes=8, procs_per_node=1, max_restarts=0)["id"]
    give_attempt(service, job_id, "node-a")
    return job_id


def test_a_jobs_words_exits_signals_faults_and_hangs_never_drain_its_node(settings: Settings):
    with live_service(settings.model_copy(update={"node_failure_limit": 2})) as service:
        alice, admin = service.client(service.token("user", "alice")), service.client(service.token("admin"))
        agent = service.client(service.token("agent", "node-a"))
        register_agent(agent, "node-a")
        diagnoses = []
        for output, cause, detail, code in JOBS_OWN:
            job_id = started(service, alice, agent)
            if output:
                piece = {"job_id": job_id, "attempt": 0, "rank": 0, "text": output, "skipped": 0}
                assert agent.post("/api/v1/agents/node-a/logs", json={"logs": [piece]}).status_code == 200
            beat(agent, "node-a", [failed(job_id, cause, detail, code)])
            [attempt] = alice.get(f"/api/v1/jobs/{job_id}").json()["attempts"]
            diagnoses.append(attempt["diagnosis"])
        # The job's report still says what it printed; the node is not condemned for it.
        assert diagnoses == ["hardware_error", "disk_full", "signal", "unknown", "hang", "hardware_error"]
        seen = node(admin)
        assert (seen["drained"], seen["evidence_count"], seen["evidence"], seen["failures"]) == (None, 0, [], 6), seen


def test_node_evidence_drains_the_node_and_stays_with_the_drain_until_returned(settings: Settings):
    with live_service(settings.model_copy(update={"node_failure_limit": 3})) as service:
        alice, admin = service.client(service.token("user", "alice")), service.client(service.token("admin"))
        agent = service.client(service.token("agent", "node-a"))
        register_agent(agent, "node-a")
        beat(agent, "node-a", health=SICK)
        beat(agent, "node-a", health=SICK + " (again)")  # still failing, its words changed: the same piece
        first, second = started(service, alice, agent), None
        beat(agent, "node-a", [failed(first, kernel=[XID_79])])
        beat(agent, "node-a", [failed(first, kernel=[XID_79])])  # sent again until acknowledged
        assert (node(admin)["evidence_count"], node(admin)["drained"]) == (2, None)

        second = started(service, alice, agent)
        beat(agent, "node-a", [failed(second, kernel=[XID_79])])  # another attempt that saw the same record
        beat(agent, "node-a", health=None)  # the check passes again: the node takes work, its evidence stays
        assert (node(admin)["evidence_count"], node(admin)["drained"]) == (2, None)
        beat(agent, "node-a", health=SICK)  # and fails again: a third piece
        drained = node(admin)
        assert drained["drained"] == ("3 pieces of node evidence within 3600 s: health_check (the agent's health "
                                      "check), xid (the agent's reading of the kernel log); drained until an admin "
                                      "returns it"), drained
        shown = [(e["kind"], e["detail"], e["job_id"], e["drained"]) for e in drained["evidence"]]
        assert shown == [("health_check", SICK, None, True), ("xid", XID_79["text"], first, True),
                         ("health_check", SICK, None, True)], shown

        returned = admin.post("/api/v1/nodes/node-a/return").json()
        assert returned["drained"] is None
        assert (node(admin)["evidence_count"], node(admin)["evidence"]) == (0, [])  # judged: it starts afresh


def test_a_node_whose_heartbeats_stop_is_lost_and_that_is_node_evidence_unless_its_job_drilled_it(
        settings: Settings):
    rule = {"node_failure_limit": 1, "heartbeat_timeout_seconds": 1.0}
    with live_service(settings.model_copy(update=rule)) as service:
        alice, admin = service.client(service.token("user", "alice")), service.client(service.token("admin"))
        for name in ("node-b", "node-c"):
            register_agent(service.client(service.token("agent", name)), name)
        # node-c's job asked for the `lose_node` drill on its rank 0: that loss is the job's doing.
        drill = [{"attempt": 0, "rank": 0, "at_step": 3, "action": "lose_node"}]
        give_attempt(service, submit(alice, nodes=8, procs_per_node=1, max_restarts=0, faults=drill)["id"], "node-c")
        lost = wait_for(lambda: node(admin, "node-b")["drained"], 30, "node-b to be lost and drained")
        assert lost.startswith("1 piece of node evidence within 3600 s: node_lost (the service: its heartbeats "
                               "stopped)"), lost
        [evidence] = node(admin, "node-b")["evidence"]
        assert (evidence["kind"], evidence["detail"]) == ("node_lost", "agent node-b sent no heartbeat for 1 s")
        drilled = wait_for(lambda: (n := node(admin, "node-c"))["state"] == "lost" and n, 30, "node-c to be lost")
        assert (drilled["drained"], drilled["evidence"]) == (None, []), drilled
