"""Agent registration and heartbeats, with commands handed back (long-polled)."""

import threading
import time

from service import commands
from service.models import Node
from tests.service.factories import register_agent


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
    with service.app.state.sessions() as session:
        node = session.query(Node).one()
        assert 29 < node.clock_offset_seconds < 32 and node.clock_skew_flagged
        assert node.stats == {"processes": 2}
    agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time()})
    with service.app.state.sessions() as session:
        assert not session.query(Node).one().clock_skew_flagged


def test_long_poll_returns_as_soon_as_a_command_is_queued(service):
    agent = service.client(service.token("agent"))
    register_agent(agent)

    def queue_later() -> None:
        time.sleep(0.5)
        with service.app.state.sessions() as session:
            node = session.query(Node).one()
            commands.enqueue(session, node, {"type": "stop", "job_id": "j", "attempt": 0, "reason": "test"})
            session.commit()  # the commit rings the node's bell

    threading.Thread(target=queue_later).start()
    started = time.monotonic()
    reply = agent.post("/api/v1/agents/node-a/heartbeat", params={"wait": 8}, json={"clock": time.time()}).json()
    assert reply["commands"] == [{"type": "stop", "job_id": "j", "attempt": 0, "reason": "test"}]
    assert time.monotonic() - started < 5  # woken by the bell, not by the end of the wait
    # A command is handed out once.
    assert agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time()}).json()["commands"] == []


def test_heartbeat_of_an_unregistered_agent_is_404(service):
    agent = service.client(service.token("agent"))
    assert agent.post("/api/v1/agents/ghost/heartbeat", json={"clock": time.time()}).status_code == 404
