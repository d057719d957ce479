"""No token and no secret of a job in any log: a full run (service and agent processes, a job of
two ranks with a secret in its environment, a failure and a restart, refused requests) and a grep
of every file it wrote outside the database."""

import logging
import sys

import httpx
import pytest
import sqlalchemy as sa

from ett.protocol import LOG_FILE
from service.db import make_engine
from tests.proofs.cluster import FAKE_RANK, cluster

pytestmark = pytest.mark.slow

JOB_SECRET = "hf_job-secret-4f1d9a7c2e"  # what a user would put in a job's env (a hub token)


def test_no_token_or_job_secret_in_any_log_line(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agent("node-0")
        spec = {"name": "secretive", "nodes": 1, "procs_per_node": 2, "max_restarts": 1,
                "entrypoint": [sys.executable, str(FAKE_RANK), "--steps", "10", "--step-seconds", "0.05"],
                "env": {"HF_TOKEN": JOB_SECRET},
                "faults": [{"attempt": 0, "rank": 1, "at_step": 3, "action": "kill"}]}  # fmt: skip
        job_id = c.submit(spec)
        assert c.wait_job(job_id)["state"] == "succeeded"  # after a failure and a restart
        c.report(job_id)
        # Refused requests: a wrong token, a token of the wrong role, a body with a secret in it.
        leaked_guess = c.tokens["alice"][:-4] + "AAAA"
        with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {leaked_guess}"}) as wrong:
            assert wrong.get("/api/v1/jobs").status_code == 401
        with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {c.tokens['node-0']}"}) as agent:
            assert agent.get("/api/v1/jobs").status_code == 403
        with c.client("user") as user:
            bad = spec | {"env": {"HF_TOKEN": JOB_SECRET, "bad name": "x"}}
            assert user.post("/api/v1/jobs", json=bad).status_code == 422
        secrets = {**{f"token of {who}": token for who, token in c.tokens.items()},
                   "wrong token": leaked_guess, "job secret": JOB_SECRET}  # fmt: skip
    # Every file the run wrote but the database (which holds the job's spec, env included, and
    # the tokens' digests): the logs of the service, the agent and each attempt, spools, state.
    written = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith("ett.db")}
    assert {"service.log", "node-0.log", LOG_FILE} <= {p.name for p in written}
    leaks = [(name, str(path)) for path, data in written.items()
             for name, secret in secrets.items() if secret.encode() in data]  # fmt: skip
    assert not leaks, f"secrets found on disk: {leaks}"


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_failed_statement_does_not_show_its_parameters(new_database_url, backend, caplog):
    """A database error names the statement, never its values: a job's env may hold a secret."""
    secret = "hunter2-" + "x" * 16
    engine = make_engine(new_database_url(backend))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE kept (name TEXT PRIMARY KEY, value TEXT)"))
            conn.execute(sa.text("INSERT INTO kept VALUES ('job', :value)"), {"value": secret})
        with caplog.at_level(logging.DEBUG, logger="sqlalchemy"), pytest.raises(sa.exc.IntegrityError) as failed:
            with engine.begin() as conn:
                conn.execute(sa.text("INSERT INTO kept VALUES ('job', :value)"), {"value": secret})
    finally:
        engine.dispose()
    assert "INSERT INTO kept" in str(failed.value) and secret not in str(failed.value)
    assert secret not in caplog.text
