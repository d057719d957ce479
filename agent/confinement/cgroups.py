"""Each attempt's processes in a cgroup v2 of their own, which the agent empties at the end.

A rank that calls `setsid`, forks and re-execs with a clean environment leaves its process group,
its session and the group's marker (agent.confinement.procs) behind; it cannot leave its cgroup. The agent
makes, under its own cgroup in the v2 hierarchy (wherever that is mounted: /sys/fs/cgroup on a
pure v2 machine, /sys/fs/cgroup/unified beside v1 controllers):

    ett-NODE-DATA/              the agent's: its node name and a digest of its data folder (a
                                restarted agent finds its predecessor's; two agents on one
                                machine, as in the tests, never share one)
        owner-UID/              one per job user, root's
            warm/               that user's warm server and its keepers, root's
            JOB.ATTEMPT.HEX/    an attempt: torchrun's guard and everything under it

Nothing of it is the job user's to write but an attempt's `cgroup.kill` (its guard empties it when
the agent dies, agent.launching.guard): moving a process needs write access to `cgroup.procs` of
the common ancestor of where it is and where it goes, so the user's processes cannot move at all,
out of their attempt or into one. Root places them: the guard before it starts anything, a warm
server before it imports, a process the warm server forks at its request, before a line of the
job runs (agent.confinement.placement, `place`). At the end of an attempt its cgroup is frozen,
killed and waited for until empty (agent.confinement.cgroup_end); when it was its owner's last
attempt on the node, every process of the owner's uid is swept (agent.confinement.uid_sweep) but
the warm servers and their keepers, then what is not a process: the uid's files in the node's
shared temporary folders (agent.confinement.uid_files) and its System V IPC objects
(agent.confinement.uid_ipc). Without a writable cgroup v2 (no v2 mount, an agent that is
not root, a read-only cgroupfs) the agent falls back to the marker scan and the uid sweep, and
says so once (docs/agent.md, "Clean-up").
"""

import contextlib
import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from agent.confinement.cgroup_end import KILL, PROCS, end_cgroup, pids_in
from agent.confinement.job_user import JobUser, make_passable
from agent.confinement.placement import Placer, PlacementRefused
from agent.confinement.uid_files import MAX_DEPTH, folders_inodes, held_files, remove_files_of
from agent.confinement.uid_ipc import remove_ipc_of
from agent.confinement.uid_keys import clear_keys_of
from agent.confinement.uid_sweep import cgroup_of, parent_pid, processes_of, sweep_uid, uids_of

log = logging.getLogger(__name__)
# Folders the job's user passes through to see its own cgroups (the README's `umask 077` would make them 0700).
FOLDER_MODE = 0o755
PLACER_SOCKET = "place.sock"


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


def agents_realm(cgroup: Path) -> bool:
    """Whether `cgroup` is some agent's: in a tree of one (a root-owned `ett-*` folder on the way) or
    where one starts its processes before it places them (it holds such a folder). A job's user can
    make neither: what it may make (its service manager's delegated tree) is its own uid's."""
    def roots(folder: Path) -> bool:
        with contextlib.suppress(OSError):
            return folder.name.startswith("ett-") and folder.stat().st_uid == 0
        return False
    with contextlib.suppress(OSError):
        return any(roots(folder) for folder in (cgroup, *cgroup.parents)) or any(map(roots, cgroup.glob("ett-*")))
    return False


class NodeCgroups:
    """This agent's cgroups; `root` None when the machine gives it none (see above). `placer_dir`: a
    folder of the agent's (no job's) where its placer listens; None: no placer (a warm-forked
    process then moves itself, which only root's may). `keep_out`: the agent's folders (its data,
    the checkpoint areas), whatever a job's uid owns in them kept by the sweep (uid_files)."""

    def __init__(self, name: str, placer_dir: Path | None = None, keep_out: Iterable[Path | None] = ()) -> None:
        self.root: Path | None = None
        self.keep_out = tuple(keep_out)
        self.placer: Placer | None = None
        self._lock = threading.Lock()  # the live attempts, read by the placer's thread
        self._live: dict[str, tuple[JobUser, Path | None]] = {}  # each live attempt's user and cgroup, by name
        mount, own = v2_mount(), own_cgroup()
        if mount is None or own is None:
            log.warning("no cgroup v2 on this machine: a job's processes are found by their marker and uid only")
            return
        root = mount / own.lstrip("/") / f"ett-{name}"
        try:
            root.mkdir(exist_ok=True)
            root.chmod(FOLDER_MODE)
            (root / PROCS).stat()
        except OSError as exc:
            log.warning("no cgroup of its own under %s (%s): a job's processes are found by their marker and uid "
                        "only", root.parent, exc.strerror)
            return
        self.mount, self.root = mount, root
        if placer_dir is not None:
            try:
                make_passable(placer_dir)
                self.placer = Placer(placer_dir / PLACER_SOCKET, self.place)
            except OSError as exc:  # a socket path past 107 bytes, say: warm-forked processes then start fresh
                log.warning("no cgroup placer in %s (%s): a job user's warm server forks nothing", placer_dir, exc)

    @property
    def placer_socket(self) -> Path | None:
        return self.placer.socket_path if self.placer is not None else None

    def close(self) -> None:
        if self.placer is not None:
            self.placer.close()

    def owner(self, uid: int) -> Path | None:
        """owner-UID and its warm/ folder, root's to write (an older agent gave the user their
        cgroup.procs: taken back)."""
        if self.root is None:
            return None
        folder = self.root / f"owner-{uid}"
        (folder / "warm").mkdir(parents=True, exist_ok=True)
        for cgroup in (folder, folder / "warm"):
            cgroup.chmod(FOLDER_MODE)
            os.chown(cgroup / PROCS, 0, 0)
        return folder

    def attempt(self, user: JobUser, name: str) -> Path | None:
        """A fresh cgroup for an attempt of this user (None: none on this machine), live until `end`."""
        owner = self.owner(user.uid)
        folder = None
        if owner is not None:
            folder = owner / name
            folder.mkdir()
            folder.chmod(FOLDER_MODE)
            with contextlib.suppress(FileNotFoundError):  # its guard empties it if the agent dies (launching.guard)
                os.chown(folder / KILL, user.uid, user.gid)
        with self._lock:
            self._live[name] = (user, folder)
        return folder

    def place(self, pid: int, uid: int, cgroup: str) -> None:
        """Moves `pid`, a process of `uid` in that user's warm/ (one its warm server forked), into
        `cgroup`, a live attempt of that user; PlacementRefused: why not. Under the lock: an
        attempt being ended (`end`) takes no process in after its kill."""
        if self.root is None:
            raise PlacementRefused("no cgroups on this node")
        warm = self.root / f"owner-{uid}" / "warm"
        with self._lock:
            if not any(user.uid == uid and folder == Path(cgroup) for user, folder in self._live.values()):
                raise PlacementRefused("not a live attempt of the caller's user")
            if self.mount / (cgroup_of(pid) or "/").lstrip("/") != warm:  # its cgroup, by the kernel's word
                raise PlacementRefused("only a process its warm server forked is moved")
            if set(uids_of(pid) or (-1,)) != {uid}:
                raise PlacementRefused("not a process of the caller's user alone")
            try:  # pid: the caller's, alive and waiting for this answer, so not one the kernel gave anew
                (Path(cgroup) / PROCS).write_text(str(pid))
            except OSError as exc:
                raise PlacementRefused(exc.strerror or str(exc)) from None

    def end(self, name: str, spare: set[int] = frozenset()) -> None:
        """Ends a live attempt: its cgroup frozen, killed, waited for until empty and removed; when it
        was its user's last live attempt here, every other process of that user swept (`sweep`)."""
        with self._lock:
            user, folder = self._live.pop(name, (None, None))
            last = user is not None and not any(u.uid == user.uid for u, _ in self._live.values())
        if folder is not None:
            end_cgroup(folder)
        if user is not None and last:
            self.sweep(user, spare)

    def sweep(self, user: JobUser, spare: set[int] = frozenset()) -> None:
        """After a user's last attempt here: its owner-UID and warm/ of anything but the warm servers
        (`spare`) and their keepers (their children); then, for a uid of one owner's alone, every
        process of that uid, wherever it runs, but those and another agent's."""
        def keep(pid: int) -> bool:
            return pid in spare or parent_pid(pid) in spare or self._elsewhere(pid)

        owner = self.owner(user.uid)
        for cgroup in (owner, owner / "warm") if owner is not None else ():
            for pid in pids_in(cgroup):
                if not keep(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        if user.owners_alone and user.uid not in (0, os.geteuid()):
            if killed := sweep_uid(user.uid, keep):
                log.warning("killed %d processes of uid %d that outlived its last attempt here: %s", len(killed),
                            user.uid, sorted(killed)[:20])
            try:
                self._remove_leftovers(user, spare)
            except OSError as exc:  # a file system failing under it ends no attempt and not the agent
                log.warning("uid %d: its leftover files and IPC objects not removed: %s", user.uid, exc)

    def _remove_leftovers(self, user: JobUser, spare: set[int]) -> None:
        """What is not a process, of a uid of one owner's alone whose processes are gone but the
        warm servers (`spare`) and their keepers: what it owns in the shared temporary folders and
        its message queues, but what those hold open or mapped, its System V IPC objects and the
        keys in its user keyrings. Left while a process of the uid runs elsewhere (another agent's on
        the same machine, as in the tests): they may be its."""
        uid, since = user.uid, time.time_ns()  # what changes from now on is not the swept attempt's (uid_files)
        left = processes_of(uid)
        if others := [pid for pid in left if pid not in spare and parent_pid(pid) not in spare]:
            log.info("uid %d: files and IPC objects kept, its processes %s run elsewhere", uid, others[:20])
            return
        files = remove_files_of(uid, held_files(left), folders_inodes(self.keep_out), since)
        ipc = remove_ipc_of(uid)
        keys = clear_keys_of(uid, user.gid)
        if files.removed or ipc or keys:
            log.info("removed %d files and %d System V IPC objects of uid %d that outlived its last attempt here%s",
                     files.removed, ipc, uid, ", and cleared its keyrings" if keys else "")
        if files.left:
            log.warning("uid %d: %d of its folders not looked into (deeper than %d, or out of time): left",
                        uid, files.left, MAX_DEPTH)

    def _elsewhere(self, pid: int) -> bool:
        """Whether a process is not this agent's to sweep: in a live attempt of its own, or in another
        agent's realm (the suite runs two agents on one machine; none of this agent's processes can
        get there, as moving needs write access to root's cgroup.procs)."""
        if self.root is None:
            return False
        where = cgroup_of(pid)
        if where is None:
            return True  # gone
        cgroup = self.mount / where.lstrip("/")
        if cgroup == self.root or self.root in cgroup.parents:
            with self._lock:
                return any(folder == cgroup for _, folder in self._live.values())
        return agents_realm(cgroup)

    def empty_leftovers(self) -> int:
        """Empties what a previous run of this agent left (it was killed: nothing ended its
        attempts, and its warm servers are gone); the number of attempts' cgroups."""
        if self.root is None:
            return 0
        attempts = [p for p in self.root.glob("owner-*/*") if p.is_dir() and p.name != "warm"]
        for attempt in attempts:
            end_cgroup(attempt)
        for cgroup in self.root.glob("owner-*/warm"):
            for pid in pids_in(cgroup) + pids_in(cgroup.parent):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return len(attempts)
