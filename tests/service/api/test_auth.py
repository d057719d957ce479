"""The auth matrix: every endpoint against every role and against no token."""

import time

import pytest

from tests.service.factories import job_spec, register_agent

JOB = "00000000000000000000000000000000"
# (method, path, body, roles allowed, what they get). Other roles get 403; no token gets 401.
# The job of the paths does not exist: an allowed role learns so (404), no other does.
ENDPOINTS = [
    ("post", "/api/v1/jobs", job_spec(), {"admin", "user"}, 201),
    ("get", "/api/v1/jobs", None, {"admin", "user"}, 200),
    ("get", f"/api/v1/jobs/{JOB}", None, {"admin", "user"}, 404),
    ("post", f"/api/v1/jobs/{JOB}/cancel", None, {"admin", "user"}, 404),
    ("post", "/api/v1/agents/register", {"name": "node-a", "address": "h", "slots": 1}, {"agent"}, 200),
    ("post", "/api/v1/agents/node-a/heartbeat", {"clock": time.time()}, {"agent"}, 200),
]
ROLES = ["admin", "user", "agent", None]


@pytest.fixture
def callers(service):
    agent_token = service.token("agent", "node-a")
    register_agent(service.client(agent_token))  # so the node of the agent rows exists
    tokens = {"admin": service.token("admin"), "user": service.token("user", "alice"), "agent": agent_token}
    return {role: service.client(tokens.get(role)) for role in ROLES}


@pytest.mark.parametrize("method,path,body,allowed,answer", ENDPOINTS, ids=[f"{e[0]} {e[1]}" for e in ENDPOINTS])
def test_auth_matrix(callers, method, path, body, allowed, answer):
    for role in ROLES:
        response = callers[role].request(method, path, json=body)
        expected = 401 if role is None else answer if role in allowed else 403
        assert response.status_code == expected, (role, response.status_code, response.text)
        assert "detail" in response.json() or response.status_code < 300


def test_bad_and_revoked_tokens_are_401(service):
    from service.models import Token

    good = service.token("user", "alice")
    assert service.client("ett_not-a-token").get("/api/v1/jobs").status_code == 401
    with service.context.sessions() as session:
        session.query(Token).update({"revoked": True})
        session.commit()
    response = service.client(good).get("/api/v1/jobs")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"


def test_tokens_are_stored_hashed(service):
    from service.models import Token

    secret = service.token("admin")
    with service.context.sessions() as session:
        stored = session.query(Token).one()
    assert secret not in stored.token_hash and len(stored.token_hash) == 64
