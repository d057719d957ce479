"""The `ett` command for the service: migrate, tokens, and the refusal to serve an old schema."""

import subprocess
import sys


def ett(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ett_cli.main", *args], env=env, capture_output=True,
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


def test_a_token_made_from_another_folder_gets_one_line_naming_the_database(tmp_path):
    # The default ETT_DATA_DIR is ./data: from another folder than the service's there is no database.
    result = subprocess.run([sys.executable, "-m", "ett_cli.main", "token", "create", "--role", "user"],
                            env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"ett: database sqlite:///{tmp_path}/data/ett.db (ETT_DATABASE_URL, or ETT_DATA_DIR=data")
    assert line.endswith("point it at the service's database")
