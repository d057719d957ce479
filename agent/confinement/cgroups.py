"""Each attempt's processes in a cgroup v2 of their own, which the agent empties at the end.

A rank that calls `setsid`, forks and re-execs with a clean environment leaves its process group,
its session and the group's marker (agent.confinement.procs) behind; it cannot leave its cgroup. The agent
makes, under its own cgroup in the v2 hierarchy (wherever that is mounted: /sys/fs/cgroup on a
pure v2 machine, /sys/fs/cgroup/unified beside v1 controllers):

    ett-NODE-DATA/              the agent's: its node name and a digest of its data folder (a
                                restarted agent finds its predecessor's; two agents on one
                                machine, as in the tests, never share one)
        owner-UID/              one per job user; only its cgroup.procs is the user's
            warm/               that user's warm server, its keepers, and nothing else for long
            JOB.ATTEMPT.HEX/    an attempt: torchrun's guard and everything under it

Only cgroup.procs files (and an attempt's cgroup.kill, for its guard) are given to the job's user:
a warm-forked process moves itself into its attempt's cgroup (the kernel lets a user move its
processes between cgroups whose common ancestor's cgroup.procs it may write: owner-UID), and
nothing of the user's can leave owner-UID. At the end the attempt's cgroup is killed (`cgroup.kill`: every process in it, atomically) and removed, and
owner-UID and warm/ are swept of whatever moved there. Without a writable cgroup v2 (no v2 mount,
an agent that is not root, a read-only cgroupfs) the agent falls back to the marker scan and says
so once (docs/agent.md, "Clean-up").
"""

import contextlib
import errno
import hashlib
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)
PROCS = "cgroup.procs"
KILL = "cgroup.kill"
KILL_WAIT_SECONDS = 5.0
# The folders a job's user passes through to move a process of its own between its cgroups: open to
# all whatever the agent's umask (the README's `umask 077` made them 0700, and a warm-forked process
# of the job's user could not enter its attempt's cgroup).
FOLDER_MODE = 0o755


def agent_cgroup_name(node_name: str, data_dir: Path) -> str:
    return f"{node_name}-{hashlib.sha256(os.fsencode(data_dir.resolve())).hexdigest()[:8]}"


def v2_mount(mountinfo: str = "/proc/self/mountinfo") -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, if it is."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        before, _, after = line.partition(" - ")
        if after.split(" ", 1)[0] == "cgroup2":
            return Path(before.split()[4])
    return None


def own_cgroup(proc_cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup in the v2 hierarchy (`0::/path`)."""
    with contextlib.suppress(OSError):
        for line in Path(proc_cgroup).read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    return None


def pids_in(cgroup: Path) -> list[int]:
    try:
        return [int(pid) for pid in (cgroup / PROCS).read_text().split()]
    except OSError:
        return []


def kill_all(cgroup: Path) -> None:
    """SIGKILLs every process in `cgroup` (not below it), until none is left or KILL_WAIT_SECONDS."""
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    while (pids := pids_in(cgroup)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def kill_cgroup(cgroup: Path) -> None:
    """Every process in `cgroup` and below it SIGKILLed at once, by the kernel (5.14 and later)."""
    with contextlib.suppress(OSError):
        (cgroup / KILL).write_text("1")


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


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            return int(stat_file.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class NodeCgroups:
    """This agent's cgroups; `root` None when the machine gives it none (see above)."""

    def __init__(self, name: str) -> None:
        self.root: Path | None = None
        mount, own = v2_mount(), own_cgroup()
        if mount is None or own is None:
            log.warning("no cgroup v2 on this machine: a job's processes are found by their marker only")
            return
        root = mount / own.lstrip("/") / f"ett-{name}"
        try:
            root.mkdir(exist_ok=True)
            root.chmod(FOLDER_MODE)
            (root / PROCS).stat()
        except OSError as exc:
            log.warning("no cgroup of its own under %s (%s): a job's processes are found by their marker only",
                        root.parent, exc.strerror)
            return
        self.root = root

    def owner(self, uid: int, gid: int) -> Path | None:
        """owner-UID, with its cgroup.procs the user's, and its warm/ folder."""
        if self.root is None:
            return None
        folder = self.root / f"owner-{uid}"
        (folder / "warm").mkdir(parents=True, exist_ok=True)
        for cgroup in (folder, folder / "warm"):
            cgroup.chmod(FOLDER_MODE)
            os.chown(cgroup / PROCS, uid, gid)
        return folder

    def attempt(self, uid: int, gid: int, name: str) -> Path | None:
        """A fresh cgroup for an attempt of this user (None: none on this machine)."""
        owner = self.owner(uid, gid)
        if owner is None:
            return None
        folder = owner / name
        folder.mkdir()
        folder.chmod(FOLDER_MODE)
        os.chown(folder / PROCS, uid, gid)  # a warm-forked rank moves itself in (agent.warm.server)
        with contextlib.suppress(FileNotFoundError):  # its guard empties it when the agent dies (agent.launching.guard)
            os.chown(folder / KILL, uid, gid)
        return folder

    def empty(self, attempt: Path, warm_servers: set[int] = frozenset()) -> None:
        """Kills every process of the attempt and removes its cgroup; then sweeps its owner's
        cgroup and warm/ of anything but the warm servers and their keepers (their children)."""
        kill_cgroup(attempt)
        kill_all(attempt)  # a kernel before 5.14 has no cgroup.kill
        remove_when_released(attempt)
        for swept in (attempt.parent, attempt.parent / "warm"):
            for pid in pids_in(swept):
                if pid not in warm_servers and parent_pid(pid) not in warm_servers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

    def empty_leftovers(self) -> int:
        """Empties what a previous run of this agent left (it was killed: nothing ended its
        attempts, and its warm servers are gone); the number of attempts' cgroups."""
        if self.root is None:
            return 0
        attempts = [p for p in self.root.glob("owner-*/*") if p.is_dir() and p.name != "warm"]
        for attempt in attempts:
            self.empty(attempt)
        return len(attempts)
