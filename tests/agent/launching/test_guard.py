"""The group's guard waiting for the master node's store before it starts torchrun (real processes)."""

import os
import signal
import socket
import subprocess
import sys
import time

from agent.confinement.procs import GROUP_MARKER_ENV
from agent.launching.launch import PACKAGES_ROOT
from tests.agent.helpers import free_port
from tests.support.waiting import wait_for

STAMP_CHILD = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text(repr(time.time()))"


def start_guard(port: int, stamp) -> subprocess.Popen:
    """The guard on a node that is not the master: --wait-for 127.0.0.1:PORT, then a child that
    writes the time it started to `stamp`."""
    argv = [sys.executable, "-m", "agent.launching.guard", str(os.getpid()), "--wait-for", f"127.0.0.1:{port}", "--",
            sys.executable, "-c", STAMP_CHILD, str(stamp)]
    return subprocess.Popen(argv, env={**os.environ, GROUP_MARKER_ENV: "guard-test"})


def catches_sigterm(pid: int) -> bool:
    """Whether the process has its SIGTERM handler installed (the kernel's SigCgt mask)."""
    status = open(f"/proc/{pid}/status").read().splitlines()
    caught = int(next(line for line in status if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & 1 << (signal.SIGTERM - 1))


def test_the_guard_starts_torchrun_only_once_the_master_listens(tmp_path):
    port, stamp = free_port(), tmp_path / "started"
    guard = start_guard(port, stamp)
    wait_for(lambda: catches_sigterm(guard.pid), 10, "the guard to be under way")
    time.sleep(0.5)  # a while of waiting for a master that is not there
    assert not stamp.exists() and guard.poll() is None  # nothing listens yet: still waiting
    with socket.create_server(("127.0.0.1", port)):
        listening_since = time.time()
        assert guard.wait(timeout=10) == 0
    assert listening_since <= float(stamp.read_text()) < listening_since + 5


def test_a_sigterm_while_the_guard_waits_ends_it_and_nothing_starts(tmp_path):
    port, stamp = free_port(), tmp_path / "started"
    guard = start_guard(port, stamp)
    wait_for(lambda: catches_sigterm(guard.pid), 10, "the guard to have installed its handlers")
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(timeout=10) == 128 + signal.SIGTERM
    time.sleep(0.2)
    assert not stamp.exists()


def test_the_guard_and_the_rank_runner_import_only_what_they_need():
    # Both start as fresh interpreters at every launch (once per node, once per rank), on CPUs the
    # other ranks are using: the agent's own modules, logging or torch would cost every restart.
    # They start without `site` (agent.launching.launch.lean_main): nothing installed may be needed.
    code = (f"import sys; sys.path.insert(0, {PACKAGES_ROOT!r}); import agent.launching.guard, "
            "agent.launching.rank_runner; print(*sys.modules)")
    loaded = subprocess.run([sys.executable, "-S", "-P", "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    heavy = {"torch", "pydantic", "logging", "dataclasses", "argparse", "pathlib", "agent.files.spool",
             "agent.warm.server", "agent.confinement.job_user", "site"}
    assert not heavy & set(loaded)
    # Of the library, only the protocol's names (exit codes, file names), its rule for blanking
    # secrets (the runner blanks them as it copies the rank's output; an event's declared fields,
    # which that rule keeps, come with it: standard library only) and what its package needs.
    assert {m for m in loaded if m.split(".")[0] == "ett"} == {"ett", "ett.errors", "ett.protocol",
                                                               "ett.protocol.redaction", "ett.protocol.event_fields"}
