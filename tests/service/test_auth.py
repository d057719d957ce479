"""The auth matrix: every endpoint against every role and against no token."""

import time

import pytest

from tests.service.factories import job_spec, register_agent

JOB = "00000000000000000000000000000000"
# (method, path, body, roles allowed). Other roles get 403; no token gets 401.
ENDPOINTS = [
    ("post", "/api/v1/jobs", job_spec(), {"admin", "user"}),
    ("get", "/api/v1/jobs", None, {"admin", "user"}),
    ("get", f"/api/v1/jobs/{JOB}", None, {"admin", "user"}),
    ("post", f"/api/v1/jobs/{JOB}/cancel", None, {"admin", "user"}),
    ("post", "/api/v1/agents/register", {"name": "node-a", "address": "h", "slots": 1}, {"agent"}),
    ("post", "/api/v1/agents/node-a/heartbeat", {"clock": time.time()}, {"agent"}),
]
ROLES = ["admin", "user", "agent", None]


@pytest.fixture
def callers(service):
    agent_token = service.token("agent", "node-a")
    register_agent(service.client(agent_token))  # so the node of the agent rows exists
    tokens = {"admin": service.token("admin"), "user": service.token("user", "alice"), "agent": agent_token}
    return {role: service.client(tokens.get(role)) for role in ROLES}


@pytest.mark.parametrize("method,path,body,allowed", ENDPOINTS, ids=[f"{m} {p}" for m, p, _, _ in ENDPOINTS])
def test_auth_matrix(callers, method, path, body, allowed):
    for role in ROLES:
        response = callers[role].request(method, path, json=body)
        if role is None:
            expected = {401}
        elif role in allowed:
            expected = {200, 201, 404}  # 404: the job of the path does not exist, which only the allowed learn
        else:
            expected = {403}
        assert response.status_code in expected, (role, response.status_code, response.text)
        assert "detail" in response.json() or response.status_code < 300


def test_bad_and_revoked_tokens_are_401(service):
    from service.models import Token

    good = service.token("user", "alice")
    assert service.client("ett_not-a-token").get("/api/v1/jobs").status_code == 401
    with service.app.state.sessions() as session:
        session.query(Token).update({"revoked": True})
        session.commit()
    response = service.client(good).get("/api/v1/jobs")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"


def test_tokens_are_stored_hashed(service):
    from service.models import Token

    secret = service.token("admin")
    with service.app.state.sessions() as session:
        stored = session.query(Token).one()
    assert secret not in stored.token_hash and len(stored.token_hash) == 64
