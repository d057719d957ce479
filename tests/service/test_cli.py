"""The `ett` command for the service: migrate, tokens, and the refusal to serve an old schema."""

import subprocess
import sys


def ett(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ett.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_service_needs_migrating_then_tokens_work(tmp_path):
    env = {"ETT_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    refused = ett("service", env=env)
    assert refused.returncode == 2 and "ett service migrate" in refused.stderr
    assert ett("service", "migrate", env=env).returncode == 0
    created = ett("token", "create", "--role", "user", "--subject", "alice", env=env)
    assert created.returncode == 0 and created.stdout.startswith("ett_")


def test_bad_setting_is_named(tmp_path):
    result = ett("service", env={"ETT_DATA_DIR": str(tmp_path), "ETT_PORT": "http", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and "ETT_PORT" in result.stderr
