"""The agents' hot paths (service/asgi/hot_paths.py): a seen agent's well-formed heartbeat and
event batch are answered without the declared routes, as those would answer them; everything
else reaches the routes with its body intact."""

import json
import time
from types import SimpleNamespace

from fastapi.testclient import TestClient

from service.asgi.hot_paths import AgentHotPaths
from service.context import context_of
from service.main import create_app
from service.models import Role
from service.security import create_token
from tests.service.factories import give_attempt


class Routes:
    """Stands where the declared routes are, behind the hot paths: records what reaches it."""

    def __init__(self) -> None:
        self.reached: list[tuple[str, bytes]] = []

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        self.reached.append((scope["path"], message.get("body", b"")))
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def test_a_seen_agent_is_answered_on_the_hot_path_and_the_rest_reaches_the_routes(settings):
    app = create_app(settings)
    routes = Routes()
    hot = AgentHotPaths(routes)
    with TestClient(app) as client:
        with context_of(app).sessions() as session:
            user, agent, stranger = (create_token(session, role, name) for role, name in
                                     ((Role.user, "alice"), (Role.agent, "node-a"), (Role.agent, "node-b")))  # fmt: skip
            session.commit()
        bearer = {"Authorization": f"Bearer {agent}"}
        # The first call of a token goes through the declared route, which looks it up and caches it.
        assert client.post("/api/v1/agents/register", headers=bearer,
                           json={"name": "node-a", "address": "127.0.0.1", "slots": 2}).status_code == 200  # fmt: skip
        # Two nodes: the one registered node cannot take it, so the scheduler leaves it to the test.
        job = client.post("/api/v1/jobs", headers={"Authorization": f"Bearer {user}"},
                          json={"name": "j", "nodes": 2, "procs_per_node": 2, "entrypoint": ["true"]}).json()  # fmt: skip
        give_attempt(SimpleNamespace(context=context_of(app)), job["id"], "node-a")
        assert client.post("/api/v1/agents/node-a/heartbeat", headers=bearer, json={"clock": time.time()}).status_code == 200

        def post(path: str, body: dict | bytes, token: str = agent, query: bytes = b"") -> tuple[int, dict | None]:
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            scope = {"type": "http", "method": "POST", "path": path, "query_string": query, "app": app,
                     "headers": [(b"authorization", f"Bearer {token}".encode()), (b"content-type", b"application/json")]}  # fmt: skip
            answer: dict = {}

            async def receive():
                return {"type": "http.request", "body": payload, "more_body": False}

            async def send(message):
                answer[message["type"]] = message

            client.portal.call(hot, scope, receive, send)  # in the app's own event loop, beside its writers
            body_out = answer["http.response.body"].get("body", b"")
            return answer["http.response.start"]["status"], json.loads(body_out) if body_out else None

        status, reply = post("/api/v1/agents/node-a/heartbeat", {"clock": time.time(), "attempts": []})
        assert status == 200 and set(reply) == {"commands", "server_time"}
        status, reply = post("/api/v1/agents/node-a/heartbeat", {"clock": time.time()}, query=b"wait=0")
        assert status == 200
        event = {"job_id": job["id"], "kind": "init_start", "ts": time.time() - 1, "attempt": 0, "source": "rank:0",
                 "seq": 1, "data": {"pid": 1}}  # fmt: skip
        for accepted in (1, 0):  # then a repeat
            answer = {"accepted": accepted, "duplicates": 1 - accepted, "refused": 0}
            assert post("/api/v1/agents/node-a/events", {"events": [event]}) == (200, answer)
        # Refusals come out as the routes' would: another node's name is not this token's.
        status, reply = post("/api/v1/agents/node-b/heartbeat", {"clock": time.time()})
        assert status == 404 and "register it first" in reply["detail"]
        assert routes.reached == []

        others = [
            ("/api/v1/agents/node-a/heartbeat", b'{"clock": "soon"}', agent, b""),  # FastAPI's 422 names the field
            ("/api/v1/agents/node-a/heartbeat", b'{"clock": 1.0}', agent, b"wait=-1"),
            ("/api/v1/agents/node-a/events", b'{"events": []}', agent, b""),
            ("/api/v1/agents/node-b/heartbeat", b'{"clock": 1.0}', stranger, b""),  # a token not seen yet
            ("/api/v1/agents/node-a/heartbeat", b'{"clock": 1.0}', user, b""),
            ("/api/v1/agents/register", b'{"name": "x"}', agent, b""),
        ]
        for path, body, token, query in others:
            assert post(path, body, token, query)[0] == 299
        assert routes.reached == [(path, body) for path, body, _, _ in others]
