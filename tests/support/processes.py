"""Finding the processes a test started, by a variable in their environment, and ending them."""

import os
import signal
import time
from pathlib import Path

# Set for the length of each test (tests/conftest.py); every process the test starts inherits it,
# unless it is given an environment of its own. Servers that outlive a test drop it (postgres.py).
TEST_MARK_ENV = "ETT_TEST_MARK"


def pids_with_env(name: str, value: str) -> list[int]:
    """Live (non-zombie) processes whose environment has name=value, read straight from /proc."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and f"{name}={value}".encode() in environ:
            found.append(int(proc.name))
    return found


def pid_alive(pid: int) -> bool:
    """Whether the process is there and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_in_cgroups_of(agent_cgroup: str) -> list[int]:
    """Live processes in an agent's cgroups (agent/confinement/cgroups.py: ett-NAME/, NAME from agent_cgroup_name)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cgroup = (proc / "cgroup").read_text()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and f"/ett-{agent_cgroup}/" in cgroup:
            found.append(int(proc.name))
    return found


def kill_marked(mark: str, timeout: float = 10.0) -> list[int]:
    """SIGKILLs every live process started under `mark` (but this one) and waits, `timeout` at
    most, until none is left alive (a signal is delivered a moment later); returns their pids."""
    pids = [pid for pid in pids_with_env(TEST_MARK_ENV, mark) if pid != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline and any(p != os.getpid() for p in pids_with_env(TEST_MARK_ENV, mark)):
        time.sleep(0.02)
    return pids
