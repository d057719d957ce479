"""Every process of a job's uid, found by the kernel's word in /proc, wherever it runs.

A cgroup holds what was born in it; a uid holds everything its user runs, also what the user got
started outside any cgroup of the agent's (its own service manager, `at`) and, on a machine
without a writable cgroup v2, what left the group's marker behind. When an owner's last attempt
on the node ends (agent.confinement.cgroups), every process of its uid that its caller does not
keep is SIGKILLed, pass after pass until a pass finds none (a process forking while it is swept).
The uid is read from /proc/PID/status (real, effective and saved): /proc/PID itself is root's once
its process makes itself undumpable.
"""

import contextlib
import os
import signal
import time
from collections.abc import Callable

SWEEP_SECONDS = 5.0


def uids_of(pid: int) -> tuple[int, ...] | None:
    """A live process's real, effective, saved and file-system uids; None: gone, or a zombie (it
    holds nothing any more, and its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            lines = status.read().splitlines()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    if fields.get("State", "").split()[:1] == ["Z"]:
        return None
    try:
        return tuple(int(uid) for uid in fields["Uid"].split())
    except (KeyError, ValueError):
        return None


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            return int(stat_file.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def cgroup_of(pid: int) -> str | None:
    """A process's cgroup in the v2 hierarchy (`/ett-.../owner-UID/NAME`); None: gone."""
    try:
        with open(f"/proc/{pid}/cgroup") as cgroups:
            for line in cgroups.read().splitlines():
                if line.startswith("0::"):
                    return line[3:]
    except OSError:
        pass
    return None


def processes_of(uid: int) -> list[int]:
    """The live processes that run as `uid` in any of their uids."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and uid in (uids_of(int(name)) or ()):
            pids.append(int(name))
    return pids


def sweep_uid(uid: int, keep: Callable[[int], bool], seconds: float = SWEEP_SECONDS) -> set[int]:
    """SIGKILLs every process of `uid` but those `keep(pid)` keeps, until a pass finds none left or
    `seconds` pass; the pids killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = [pid for pid in processes_of(uid) if pid != os.getpid() and not keep(pid)]
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.01)
    return killed
