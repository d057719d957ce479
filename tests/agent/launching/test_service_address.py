"""Where `ett agent` and the user's commands find the service when none is named: one rule
(ett.protocol.service_url), ETT_SERVICE_URL, else this machine's service at ETT_PORT, so a shell
that moved its service (README, "Your first ten minutes") moves its agents and commands with it.
Real processes against the real service on loopback."""

import os
import signal
import subprocess
import sys

import pytest
from sqlalchemy import select

from service.models import Node
from tests.support.job_user import SUITE_USER_JOBS
from tests.support.waiting import wait_for

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def shell(**variables: str) -> dict[str, str]:
    """This environment less any service address it names, plus `variables`."""
    named = ("ETT_SERVICE_URL", "ETT_AGENT_SERVICE_URL", "ETT_PORT")
    return {k: v for k, v in os.environ.items() if k not in named} | variables


def ett(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ett_cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def registered(service, name: str) -> bool:
    with service.context.sessions() as session:
        return session.scalar(select(Node).where(Node.name == name)) is not None


def test_an_agent_and_the_commands_given_only_ett_port_reach_the_service_on_it(service, tmp_path):
    port = service.url.rsplit(":", 1)[1]
    assert port != "8000"  # a free port: the default would not reach it
    env = shell(ETT_PORT=port) | SUITE_USER_JOBS | {
        "ETT_AGENT_TOKEN": service.token("agent", "node-p"), "ETT_AGENT_WARM_START": "false"}
    agent = subprocess.Popen([sys.executable, "-m", "ett_cli.main", "agent", "--name", "node-p", "--slots", "1",
                              "--data-dir", str(tmp_path / "agent")], env=env)  # fmt: skip
    try:
        wait_for(lambda: registered(service, "node-p") or agent.poll() is not None, 90, "the agent to register")
        assert agent.poll() is None, f"the agent ended with {agent.returncode}"
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
    listed = ett("nodes", env=shell(ETT_PORT=port, ETT_TOKEN=service.token("admin")))
    assert listed.returncode == 0 and "node-p" in listed.stdout, listed.stderr


def test_a_bad_ett_port_or_service_url_is_named_in_one_line(service, tmp_path):
    for variables, said in (({"ETT_PORT": "http"}, "ETT_PORT=http is not a port (1-65535)"),
                            ({"ETT_SERVICE_URL": "127.0.0.1:8000"},
                             "ETT_SERVICE_URL=127.0.0.1:8000 must start with http:// or https://")):  # fmt: skip
        command = ett("jobs", env=shell(ETT_TOKEN="t", **variables))
        assert (command.returncode, command.stderr) == (1, f"ett: {said}\n")
        agent = ett("agent", "--data-dir", str(tmp_path / "agent"), env=shell(ETT_AGENT_TOKEN="t", **variables))
        assert (agent.returncode, agent.stderr) == (2, f"ett agent: {said}\n")
    # A service named explicitly wins over a bad ETT_PORT: the commands never read it.
    command = ett("jobs", "--service", service.url, env=shell(ETT_TOKEN=service.token("admin"), ETT_PORT="http"))
    assert command.returncode == 0, command.stderr
