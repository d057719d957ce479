"""An agent inside a Slurm allocation (SLURM_JOB_ID set) refuses to start, saying why in one line,
when a job of its could read its token or every owner's jobs would share one account
(agent/slurm.py, docs/slurm.md "Who runs what"). A real `ett agent` process each time; it stops
before it makes anything on the node."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.settings import AgentSettings

REPO = Path(__file__).resolve().parents[3]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="an agent started as root runs a uid per owner")


def start_agent(tmp_path: Path, token_mode: int = 0o600, token_uid: int | None = None,
                **env: str) -> subprocess.CompletedProcess:  # fmt: skip
    token = tmp_path / "agent.token"
    token.write_text("a-secret-token\n")
    token.chmod(token_mode)
    if token_uid is not None:
        os.chown(token, token_uid, token_uid)
    agent_env = {k: v for k, v in os.environ.items() if not k.startswith(("ETT_", "SLURM_"))} | {
        "SLURM_JOB_ID": "4211", "ETT_AGENT_TOKEN_FILE": str(token), "ETT_AGENT_DATA_DIR": str(tmp_path / "data"),
        "ETT_AGENT_SERVICE_URL": "http://127.0.0.1:9"} | env  # fmt: skip
    return subprocess.run([sys.executable, "-m", "agent.cli"], env=agent_env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_one_user_for_every_owners_jobs_is_refused_in_an_allocation(tmp_path):
    # As root with a job user named, or as any other user (which runs jobs as itself): one account.
    done = start_agent(tmp_path, ETT_AGENT_JOB_USER="root", ETT_AGENT_ALLOW_ROOT_JOBS="true")
    assert done.returncode == 2, done.stderr
    assert "in a Slurm allocation" in done.stderr and "ETT_AGENT_JOB_USER" in done.stderr, done.stderr
    assert not (tmp_path / "data").exists()


@root_only
def test_a_token_file_others_could_read_is_refused_in_an_allocation(tmp_path):
    done = start_agent(tmp_path, token_mode=0o640)
    assert done.returncode == 2, done.stderr
    assert "is mode 640: other users could read the token" in done.stderr, done.stderr
    assert not (tmp_path / "data").exists()


@root_only
def test_a_token_file_of_a_jobs_uid_is_refused_in_an_allocation(tmp_path):
    job_uid = AgentSettings.model_fields["job_uid_base"].default + 3  # owner number 3's jobs
    done = start_agent(tmp_path, token_uid=job_uid)
    assert done.returncode == 2, done.stderr
    assert f"belongs to uid {job_uid}, a job's" in done.stderr, done.stderr
    assert not (tmp_path / "data").exists()
