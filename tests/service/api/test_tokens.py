"""Tokens over their life: `ett token create --expires-in`, `ett token list`, `ett token revoke`,
on the service's database, and what the live service then answers (user and agent paths)."""

import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest

from service.models import Role
from service.security import create_token
from tests.service.factories import register_agent

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def ett(settings, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"ETT_DATABASE_URL": settings.resolved_database_url}
    return subprocess.run([sys.executable, "-m", "ett_cli.main", "token", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def rows(listing: str) -> dict[str, list[str]]:
    """`ett token list` by subject: [id, role, subject, created date, time, expires..., state]."""
    return {line.split()[2]: line.split() for line in listing.strip().splitlines()[1:]}


def test_tokens_are_listed_without_secrets_revoked_by_id_and_refused_from_then_on(service, settings):
    alice = ett(settings, "create", "--role", "user", "--subject", "alice").stdout.strip()
    bob = ett(settings, "create", "--role", "user", "--subject", "bob", "--expires-in", "30d").stdout.strip()
    assert service.client(alice).get("/api/v1/jobs").status_code == 200

    listing = ett(settings, "list")
    assert listing.returncode == 0 and alice not in listing.stdout and bob not in listing.stdout
    table = rows(listing.stdout)
    assert table["alice"][-2:] == ["never", "valid"]
    in_30_days = (datetime.now(UTC) + timedelta(days=30)).strftime("%Y-%m-%d")
    assert table["bob"][5] == in_30_days and table["bob"][-1] == "valid"

    revoked = ett(settings, "revoke", table["alice"][0])
    assert revoked.returncode == 0 and revoked.stdout.strip() == f"revoked {table['alice'][0]}"
    assert service.client(alice).get("/api/v1/jobs").status_code == 401
    assert service.client(bob).get("/api/v1/jobs").status_code == 200
    assert rows(ett(settings, "list").stdout)["alice"][-1] == "revoked"

    unknown = ett(settings, "revoke", "999")
    assert unknown.returncode == 2 and unknown.stderr.strip() == "ett: no token with id 999 (see `ett token list`)"
    bad = ett(settings, "create", "--role", "user", "--expires-in", "soon")
    assert bad.returncode == 2 and "'soon' is not a duration like 90m, 12h or 30d" in bad.stderr


def test_an_expired_token_is_refused_by_users_and_agents_paths_even_once_seen(service):
    with service.context.sessions() as session:
        past = create_token(session, Role.user, "carol", expires_at=datetime.now(UTC) - timedelta(seconds=1))
        agent = create_token(session, Role.agent, "node-x", expires_at=datetime.now(UTC) + timedelta(seconds=2))
        session.commit()
    assert service.client(past).get("/api/v1/jobs").status_code == 401
    with service.client(agent) as client:
        register_agent(client, "node-x")
        assert client.post("/api/v1/agents/node-x/heartbeat", json={"clock": time.time()}).status_code == 200
        time.sleep(2.1)  # the caller is cached by now: its expiry must still be checked
        assert client.post("/api/v1/agents/node-x/heartbeat", json={"clock": time.time()}).status_code == 401
