"""Agent registration and heartbeats, with commands handed back (long-polled)."""

import asyncio
import threading
import time

from sqlalchemy import select

from ett.protocol.messages import AttemptReport, StopCommand
from service.agents import commands
from service.jobs.heartbeats import HeartbeatWriter
from service.models import Attempt, AttemptNode, Node
from service.schemas.agents import Heartbeat
from service.security import Caller, find_token
from tests.service.factories import register_agent, submit
from tests.support.waiting import wait_for


def test_register_is_idempotent_per_token(service):
    agent = service.client(service.token("agent", "node-a"))
    first = register_agent(agent, slots=2)
    again = register_agent(agent, slots=4)
    assert first["name"] == again["name"] == "node-a" and again["slots"] == 4
    other = service.client(service.token("agent", "intruder"))
    response = other.post("/api/v1/agents/register", json={"name": "node-a", "address": "x", "slots": 1})
    assert response.status_code == 403
    assert other.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time()}).status_code == 403


def test_heartbeat_records_clock_offset_and_flags_large_skew(service):
    agent = service.client(service.token("agent"))
    register_agent(agent)
    reply = agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time() - 30, "stats": {"processes": 2}})
    assert reply.status_code == 200 and reply.json()["commands"] == []
    with service.context.sessions() as session:
        node = session.query(Node).one()
        assert 29 < node.clock_offset_seconds < 32 and node.clock_skew_flagged
        assert node.stats == {"processes": 2}
    agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time()})
    with service.context.sessions() as session:
        assert not session.query(Node).one().clock_skew_flagged


def test_long_poll_returns_as_soon_as_a_command_is_queued(service):
    agent = service.client(service.token("agent"))
    register_agent(agent)

    def queue_later() -> None:
        time.sleep(0.5)
        with service.context.sessions() as session:
            node = session.query(Node).one()
            commands.enqueue(session, node, StopCommand(type="stop", job_id="j", attempt=0, reason="test"))
            session.commit()  # the commit rings the node's bell

    threading.Thread(target=queue_later).start()
    started = time.monotonic()
    reply = agent.post("/api/v1/agents/node-a/heartbeat", params={"wait": 60}, json={"clock": time.time()}).json()
    assert reply["commands"] == [{"type": "stop", "job_id": "j", "attempt": 0, "reason": "test", "at_once": False}]
    # Woken by the bell, not by the end of the 60 s wait (half of it: a margin no load eats).
    assert time.monotonic() - started < 30
    # A command is handed out once.
    assert agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time()}).json()["commands"] == []


def test_long_poll_wakes_for_a_command_committed_without_this_apps_bell(service):
    # Another service process is stood in for by a session factory of this same process that
    # rings no bell: only the bell's watch of the database can find its command.
    from service.db import make_session_factory

    agent = service.client(service.token("agent"))
    register_agent(agent)
    other_process = make_session_factory(service.context.engine)

    def queue_later() -> None:
        time.sleep(0.5)
        with other_process() as session:
            commands.enqueue(session, session.query(Node).one(),
                             StopCommand(type="stop", job_id="j", attempt=0, reason="test"))
            session.commit()

    threading.Thread(target=queue_later).start()
    started = time.monotonic()
    reply = agent.post("/api/v1/agents/node-a/heartbeat", params={"wait": 60}, json={"clock": time.time()}).json()
    assert [c["type"] for c in reply["commands"]] == ["stop"]
    assert time.monotonic() - started < 30  # found by the bell's watch, not at the end of the 60 s wait


def test_heartbeat_of_an_unregistered_agent_is_404(service):
    agent = service.client(service.token("agent"))
    assert agent.post("/api/v1/agents/ghost/heartbeat", json={"clock": time.time()}).status_code == 404


def test_revoked_agent_token_is_refused_from_its_next_request(service):
    from service.models import Token

    agent = service.client(service.token("agent"))
    register_agent(agent)
    assert agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time()}).status_code == 200
    with service.context.sessions() as session:
        session.query(Token).update({"revoked": True})
        session.commit()
    # The service keeps the callers of tokens it has seen; revocation must still apply at once.
    assert agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time()}).status_code == 401
    event = {"job_id": "j", "kind": "init_start", "ts": time.time(), "attempt": 0, "source": "rank:0", "seq": 0}
    assert agent.post("/api/v1/agents/node-a/events", json={"events": [event]}).status_code == 401


def test_heartbeats_written_together_each_get_their_own_answer(service):
    """Heartbeats that arrive together are written in one batch: an error stays with its own."""
    from service.models import Token

    good = {f"node-{i}": service.token("agent", f"node-{i}") for i in range(8)}
    for name, token in good.items():
        register_agent(service.client(token), name)
    revoked = service.token("agent", "node-r")
    register_agent(service.client(revoked), "node-r")
    service.client(revoked).post("/api/v1/agents/node-r/heartbeat", json={"clock": time.time()})  # seen: cached
    with service.context.sessions() as session:
        session.query(Token).filter(Token.subject == "node-r").update({"revoked": True})
        session.commit()
    calls = [(token, name, 200) for name, token in good.items()] + [
        (good["node-0"], "node-1", 403),  # another agent's node
        (good["node-0"], "ghost", 404),
        (revoked, "node-r", 401),
    ]
    answers: dict[int, list[int]] = {}
    start = threading.Barrier(len(calls))

    def beat(i: int, token: str, name: str) -> None:
        with service.client(token) as client:
            start.wait()
            body = {"clock": time.time(), "stats": {"processes": i}}
            answers[i] = [client.post(f"/api/v1/agents/{name}/heartbeat", json=body).status_code for _ in range(5)]

    threads = [threading.Thread(target=beat, args=(i, token, name)) for i, (token, name, _) in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == {i: [expected] * 5 for i, (_, _, expected) in enumerate(calls)}
    with service.context.sessions() as session:
        stats = {node.name: node.stats for node in session.query(Node)}
    assert stats == {f"node-{i}": {"processes": i} for i in range(8)} | {"node-r": {}}


def test_a_node_reports_only_its_own_attempts(service):
    # Two agents, each with its own token; the job runs on node-a only. node-b's heartbeat that
    # reports the job's attempt failed is answered but changes nothing; node-a's own report does.
    from tests.service.factories import submit

    node_a = service.client(service.token("agent", "node-a"))
    node_b = service.client(service.token("agent", "node-b"))
    register_agent(node_a, "node-a", slots=1)
    job = submit(service.client(service.token("user", "alice")), nodes=1, procs_per_node=1)
    deadline = time.monotonic() + 30
    while not (attempts := service.client(service.token("admin")).get(f"/api/v1/jobs/{job['id']}").json()["attempts"]):
        assert time.monotonic() < deadline, "the job was never allocated"
        time.sleep(0.1)
    assert attempts[0]["nodes"] == ["node-a"]
    register_agent(node_b, "node-b", slots=1)
    failed = {"job_id": job["id"], "attempt": 0, "state": "failed", "cause": "exit", "detail": "forged", "exit_code": 1}

    reply = node_b.post("/api/v1/agents/node-b/heartbeat", json={"clock": time.time(), "attempts": [failed]})
    assert reply.status_code == 200
    admin = service.client(service.token("admin"))
    assert admin.get(f"/api/v1/jobs/{job['id']}").json()["attempts"][0]["state"] != "failed"

    node_a.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time(), "attempts": [failed]})
    first = admin.get(f"/api/v1/jobs/{job['id']}").json()["attempts"][0]
    assert (first["state"], first["detail"]) == ("failed", "forged")


def test_the_reports_of_two_nodes_in_one_batch_each_go_to_their_own_share(service):
    """Heartbeats written together (one transaction, service/jobs/heartbeats.py): each node's
    report of the same attempt changes that node's share, not its peer's."""
    tokens = {name: service.token("agent", name) for name in ("node-a", "node-b")}
    for name, token in tokens.items():
        register_agent(service.client(token), name, slots=1)
    job = submit(service.client(service.token("user", "alice")), nodes=2, procs_per_node=1)
    admin = service.client(service.token("admin"))
    wait_for(lambda: admin.get(f"/api/v1/jobs/{job['id']}").json()["attempts"], 30, "the job's allocation")
    with service.context.sessions() as session:
        callers = {name: Caller(t.id, t.role, t.subject) for name in tokens
                   if (t := find_token(session, tokens[name])) is not None}  # fmt: skip

    def report(state: str) -> dict:
        return {"job_id": job["id"], "attempt": 0, "state": state, "cause": None, "detail": "", "exit_code": None}

    def beat_together(states: dict[str, str]) -> None:
        writer = HeartbeatWriter(service.context.sessions, service.context.settings)

        async def run() -> None:
            task = asyncio.create_task(writer.run())
            try:
                await asyncio.gather(*(writer.record(name, callers[name], Heartbeat(clock=time.time(),
                                       attempts=[AttemptReport(**report(state))]), time.time())
                                       for name, state in states.items()))  # fmt: skip
            finally:
                task.cancel()

        asyncio.run(run())

    def shares() -> dict[str, str]:
        with service.context.sessions() as session:
            rows = session.execute(select(Node.name, AttemptNode.state).join(AttemptNode.node)
                                   .join(AttemptNode.attempt).where(Attempt.job_id == job["id"]))
            return {name: state.value for name, state in rows}

    beat_together({"node-a": "succeeded", "node-b": "running"})
    assert shares() == {"node-a": "succeeded", "node-b": "running"}
    assert admin.get(f"/api/v1/jobs/{job['id']}").json()["state"] == "running"
    beat_together({"node-b": "succeeded", "node-a": "running"})  # an ended share is not taken back
    assert shares() == {"node-a": "succeeded", "node-b": "succeeded"}
    assert admin.get(f"/api/v1/jobs/{job['id']}").json()["state"] == "succeeded"
