"""Helpers shared by the agent tests: launch commands for the fake rank, waiting, the process table."""

import json
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from agent.groups.supervisor import Supervisor
from ett.protocol.messages import LaunchCommand, command_adapter

FAKE_RANK = Path(__file__).parent / "scripts" / "fake_rank.py"
ETT_RANK = Path(__file__).parent / "scripts" / "ett_rank.py"  # the same, written with the ett library


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(*fake_args: str, nproc: int = 2, **fields: Any) -> LaunchCommand:
    command = {
        "type": "launch", "job_id": uuid.uuid4().hex, "attempt": 0, "node_rank": 0, "nnodes": 1,
        "nproc_per_node": nproc, "master_addr": "127.0.0.1", "master_port": free_port(),
        "entrypoint": [sys.executable, str(FAKE_RANK), *fake_args],
        "hang_timeout_seconds": 30, "init_timeout_seconds": 60,
    } | fields  # fmt: skip
    return command_adapter.validate_python(command)


def run_to_end(supervisor: Supervisor, timeout: float = 120.0) -> dict[str, Any]:
    """Polls like the daemon's monitor loop until the only attempt ends; its final report."""
    [key] = supervisor.groups
    deadline = time.monotonic() + timeout
    while supervisor.groups:
        assert time.monotonic() < deadline, f"attempt still {supervisor.groups[key].state} after {timeout}s"
        supervisor.poll()
        time.sleep(0.05)
    [report] = supervisor.reports.snapshot()
    return report.model_dump()


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
