"""The end of a cgroup: frozen, killed, waited for until the kernel says it is empty, removed.

An attempt's processes may fork while they are being killed: SIGKILLing what `cgroup.procs` lists,
once, misses a child born after the list was read. So the cgroup is frozen first (`cgroup.freeze`:
none of its processes runs again, so none forks), then every process in it is SIGKILLed at once by
the kernel (`cgroup.kill`, Linux 5.14; SIGKILL reaches a frozen process), and the agent waits until
`cgroup.events` says `populated 0` (no process left in it or below it), KILL_WAIT_SECONDS at most,
before it removes the cgroup. On a kernel without `cgroup.kill` the agent SIGKILLs each pid
`cgroup.procs` lists, again until none is left: frozen, they cannot fork out of its sight.
"""

import contextlib
import errno
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)
PROCS = "cgroup.procs"
KILL = "cgroup.kill"
FREEZE = "cgroup.freeze"
EVENTS = "cgroup.events"
KILL_WAIT_SECONDS = 5.0
POLL_SECONDS = 0.005


def pids_in(cgroup: Path) -> list[int]:
    """The processes in `cgroup` itself (not below it)."""
    try:
        return [int(pid) for pid in (cgroup / PROCS).read_text().split()]
    except OSError:
        return []


def populated(cgroup: Path) -> bool:
    """Whether a process is left in `cgroup` or below it, by the kernel's word (a cgroup that is
    gone holds none)."""
    try:
        events = (cgroup / EVENTS).read_text().split()
    except OSError:
        return False
    return events[events.index("populated") + 1] != "0" if "populated" in events else bool(pids_in(cgroup))


def kill_cgroup(cgroup: Path) -> bool:
    """Every process in `cgroup` and below it SIGKILLed at once, by the kernel; False on a kernel
    without `cgroup.kill` (before 5.14), where the caller SIGKILLs each one."""
    try:
        (cgroup / KILL).write_text("1")
    except FileNotFoundError:
        return not cgroup.exists()  # a cgroup that is gone holds nothing to kill
    except OSError as exc:
        log.warning("cgroup %s: cgroup.kill: %s", cgroup, exc.strerror)
        return False
    return True


def kill_each(cgroup: Path, deadline: float) -> None:
    """SIGKILLs every process `cgroup.procs` lists until none is left or `deadline` (time.monotonic)."""
    while (pids := pids_in(cgroup)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(POLL_SECONDS)


def freeze(cgroup: Path) -> None:
    with contextlib.suppress(OSError):  # no freezer (before 5.2): the kill below still comes
        (cgroup / FREEZE).write_text("1")


def end_cgroup(cgroup: Path, wait: float = KILL_WAIT_SECONDS) -> bool:
    """Freezes `cgroup`, kills everything in it, waits until it is empty and removes it (above);
    whether it is gone. One still populated after `wait` (a process stuck in the kernel) is left,
    frozen, and said in the log; a restarted agent empties it (NodeCgroups.empty_leftovers)."""
    deadline = time.monotonic() + wait
    freeze(cgroup)
    if not kill_cgroup(cgroup):
        kill_each(cgroup, deadline)
    while populated(cgroup):
        if time.monotonic() >= deadline:
            log.warning("cgroup %s still holds %s after %gs: left frozen", cgroup, pids_in(cgroup) or "processes",
                        wait)
            return False
        time.sleep(POLL_SECONDS)
    return remove_when_released(cgroup, max(deadline - time.monotonic(), 1.0))


def remove_when_released(cgroup: Path, wait: float = KILL_WAIT_SECONDS) -> bool:
    """Removes an emptied cgroup; whether it is gone. A process killed a moment ago has left
    cgroup.procs but may still hold the cgroup (EBUSY) until the kernel has released it: tried
    again for up to `wait` seconds (a loaded machine left cgroups behind otherwise)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            cgroup.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                log.warning("cgroup %s not removed: %s", cgroup, exc.strerror)
                return False
        time.sleep(0.01)
