"""What a job's uid leaves in the node's shared temporary folders, removed after its owner's last
attempt on the node (agent.confinement.cgroups): /dev/shm (POSIX shared memory and semaphores,
PyTorch's shared tensors), /tmp, /var/tmp and /run/lock (anyone may write in each), POSIX message
queues. Its processes are gone by then (agent.confinement.uid_sweep); these would hold memory and
disk for good. The message queues are walked in a mount of their file system that is attached
nowhere (fsmount: no process sees it, it goes with its descriptor): most nodes mount none at
/dev/mqueue, and a queue lives without one (a review's job left one where none was mounted).

Root walks each folder from a held descriptor, never following a link (each folder opened with
O_NOFOLLOW from its parent's descriptor, its owner and mode read from the descriptor), staying on
the folder's file system, and removes by name only entries the uid owns (lstat): what another uid
owns is never removed, whichever folder it is in. It goes down only into folders the uid could
have written in: its own, and those anyone may write in (/tmp's shared ones). So root removes
nothing the uid could not have removed itself. Left alone:
- `spare_files`: what the uid's surviving processes (its warm server and keepers) hold open or
  mapped, by device and inode (held_files);
- `keep_out`: the agent's own folders (its data, the checkpoint areas, where a job's files are
  its results), by device and inode, if they are below one of the folders;
- what changed since `changed_since_ns` (time.time_ns()): another run's (tests start several
  agents, and their jobs, as one uid on one machine), not the swept attempt's, which ended before.
Bounded: folders MAX_DEPTH deep at most (a descriptor each, held) and `seconds` in all; what is left
is counted, for the log.
"""

import contextlib
import ctypes
import os
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SHARED_FOLDERS = (Path("/dev/shm"), Path("/tmp"), Path("/var/tmp"), Path("/run/lock"))
MQUEUE_FOLDER = Path("/dev/mqueue")  # where the node mounts its queues, if it does: walked where no fsmount is
# fsopen, fsconfig, fsmount: one number on every architecture (Linux 5.2 on); flags and command.
SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 430, 431, 432
FS_CLOEXEC, FSCONFIG_CMD_CREATE = 1, 6
_libc = ctypes.CDLL(None, use_errno=True)
MAX_DEPTH = 64
WALK_SECONDS = 5.0
FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Removed:
    removed: int = 0  # entries removed
    left: int = 0  # folders not looked into: too deep, or out of time


def inode(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def held_files(pids: Iterable[int]) -> set[tuple[int, int]]:
    """The files these processes hold open or mapped (root reads their /proc, also an undumpable
    one's), by device and inode."""
    held = set()
    for pid in pids:
        for kind in ("fd", "map_files"):
            with contextlib.suppress(OSError):
                for name in os.listdir(f"/proc/{pid}/{kind}"):
                    with contextlib.suppress(OSError):  # a magic link: the file itself, whatever its path
                        held.add(inode(os.stat(f"/proc/{pid}/{kind}/{name}")))
    return held


def folders_inodes(folders: Iterable[Path | None]) -> set[tuple[int, int]]:
    """The agent's own folders, by device and inode (those that exist)."""
    found = set()
    for folder in folders:
        if folder is not None:
            with contextlib.suppress(OSError):
                found.add(inode(os.stat(folder)))
    return found


class _Walk:
    def __init__(self, uid: int, spare_files: set[tuple[int, int]], keep_out: set[tuple[int, int]],
                 changed_since_ns: int, deadline: float) -> None:
        self.uid, self.spare, self.keep_out = uid, spare_files, keep_out
        self.changed_since_ns = changed_since_ns
        self.deadline = deadline
        self.result = Removed()

    def theirs(self, st: os.stat_result) -> bool:
        return st.st_uid == self.uid and st.st_ctime_ns < self.changed_since_ns and inode(st) not in self.spare

    def enterable(self, st: os.stat_result, device: int) -> bool:
        """A folder the uid could have written in, on the walked file system, not the agent's."""
        return (stat.S_ISDIR(st.st_mode) and st.st_dev == device and inode(st) not in self.keep_out
                and (st.st_uid == self.uid or bool(st.st_mode & stat.S_IWOTH)))

    def folder(self, top: Path | int) -> None:
        """Walks `top`, a path or a held folder's descriptor (taken over: closed here)."""
        try:
            fd = os.open(top, FOLDER) if isinstance(top, Path) else top
        except OSError:
            return  # none here, or a link (/var/tmp to /tmp, say): not walked through
        device = os.fstat(fd).st_dev
        # Each level: its descriptor, its entries read as they come (a folder of millions costs no
        # memory), and, for a folder of the uid's, its name in the level above (removed once
        # emptied, if nothing else is left in it).
        stack: list[tuple[int, Iterator[os.DirEntry], str | None]] = []
        self._push(stack, fd, None)
        try:
            while stack:
                if time.monotonic() > self.deadline:
                    self.result.left += len(stack)
                    return
                fd, entries, own_name = stack[-1]
                try:
                    entry = next(entries, None)
                except OSError:  # the folder went, or its file system failed: what is left there stays
                    entry = None
                if entry is not None:
                    self._entry(stack, fd, entry.name, device)
                    continue
                self._pop(stack)
                if own_name is not None and stack:
                    with contextlib.suppress(OSError):  # not empty: what is left is another uid's, or spared
                        os.rmdir(own_name, dir_fd=stack[-1][0])
                        self.result.removed += 1
        finally:
            while stack:
                self._pop(stack)

    @staticmethod
    def _push(stack: list, fd: int, own_name: str | None) -> None:
        try:
            entries = os.scandir(fd)
        except OSError:
            os.close(fd)
            return
        stack.append((fd, entries, own_name))

    @staticmethod
    def _pop(stack: list) -> None:
        fd, entries, _ = stack.pop()
        entries.close()
        os.close(fd)

    def _entry(self, stack: list, fd: int, name: str, device: int) -> None:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return  # gone meanwhile
        if not stat.S_ISDIR(st.st_mode):
            if self.theirs(st):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
                    self.result.removed += 1
            return
        if not self.enterable(st, device):
            return
        if len(stack) >= MAX_DEPTH:
            self.result.left += 1
            return
        try:
            inner = os.open(name, FOLDER, dir_fd=fd)
        except OSError:
            return
        if not self.enterable(os.fstat(inner), device):  # what is there now, not what was looked at
            os.close(inner)
            return
        self._push(stack, inner, name if self.theirs(st) else None)


def message_queues() -> int | Path:
    """The node's POSIX message queues: a descriptor of a mount of their file system attached nowhere
    (above), or MQUEUE_FOLDER where the kernel makes none (older than 5.2, no right to)."""
    fs = _libc.syscall(SYS_FSOPEN, b"mqueue", FS_CLOEXEC)
    if fs < 0:
        return MQUEUE_FOLDER
    try:
        mount = _libc.syscall(SYS_FSMOUNT, fs, FS_CLOEXEC, 0) \
            if _libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0) == 0 else -1
    finally:
        os.close(fs)
    if mount < 0:
        return MQUEUE_FOLDER
    try:  # its root, as a folder to list (fsmount gives a descriptor of a place, not an open folder)
        return os.open(".", FOLDER, dir_fd=mount)
    except OSError:
        return MQUEUE_FOLDER
    finally:
        os.close(mount)


def remove_files_of(uid: int, spare_files: set[tuple[int, int]], keep_out: set[tuple[int, int]],
                    changed_since_ns: int, folders: Iterable[Path] | None = None,
                    seconds: float = WALK_SECONDS) -> Removed:
    """Removes what `uid` owns in `folders` (None: SHARED_FOLDERS and the message queues) but what is
    spared (above); how many, and how many folders were left unseen."""
    walk = _Walk(uid, spare_files, keep_out, changed_since_ns, time.monotonic() + seconds)
    for folder in (*SHARED_FOLDERS, message_queues()) if folders is None else folders:
        walk.folder(folder)
    return walk.result
