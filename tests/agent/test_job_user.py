"""The agent refuses, in one line naming the setting, to start where its jobs would run as root or
could not run at all (an agent started as root; the tests here are run as root on CI)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="an agent started as root")


def start_agent(tmp_path, **settings: str) -> subprocess.CompletedProcess:
    env = os.environ | {"ETT_AGENT_TOKEN": "t", "ETT_AGENT_DATA_DIR": str(tmp_path / "agent")} | {
        f"ETT_AGENT_{name.upper()}": value for name, value in settings.items()}
    return subprocess.run([sys.executable, "-m", "agent.cli"], env=env, capture_output=True, text=True, timeout=120)


def test_root_is_no_job_user_unless_allowed_explicitly(tmp_path):
    result = start_agent(tmp_path, job_user="root")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ett agent: ETT_AGENT_JOB_USER=root is root: every user's job would run as root on this node; "
        "set ETT_AGENT_ALLOW_ROOT_JOBS=true to allow it"]


def test_an_unknown_job_user_is_named(tmp_path):
    result = start_agent(tmp_path, job_user="no-such-user-here")
    assert result.returncode == 2 and "ETT_AGENT_JOB_USER=no-such-user-here: no such user" in result.stderr


def test_an_interpreter_the_job_user_cannot_run_stops_the_agent_with_what_to_set(tmp_path):
    closed = tmp_path / "python"  # pytest's folders are closed to other users, as /root is
    closed.symlink_to(sys.executable)
    result = start_agent(tmp_path, job_python=str(closed))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ett agent: job user nobody cannot run {closed}: Permission denied;")
    assert "ETT_AGENT_JOB_PYTHON" in last
