"""A job uid's System V IPC objects (shared memory segments, semaphore sets, message queues),
removed after its owner's last attempt on the node (agent.confinement.cgroups): the kernel keeps
them until someone removes them, and a segment holds its memory for good.

The kernel's word on who owns them is /proc/sysvipc (the agent's IPC namespace: the node's, the
jobs' too). An object is the uid's when it owns it or created it: its creator may hand the owner
field to any uid. Removed with IPC_RMID, which root may do to any: a segment still attached (by
a warm server, say) is destroyed when its last process detaches, so nothing loses a mapping.
"""

import contextlib
import ctypes
from pathlib import Path

SYSVIPC = Path("/proc/sysvipc")
IPC_RMID = 0
ID_COLUMNS = {"shm": "shmid", "sem": "semid", "msg": "msqid"}
_libc = ctypes.CDLL(None, use_errno=True)


def objects_of(uid: int, sysvipc: Path = SYSVIPC) -> list[tuple[str, int]]:
    """The uid's IPC objects: (kind, id), kind one of shm, sem, msg."""
    found = []
    for kind, id_column in ID_COLUMNS.items():
        try:
            header, *rows = (sysvipc / kind).read_text().splitlines()
        except (OSError, ValueError):
            continue  # no System V IPC in this kernel
        columns = header.split()
        at = {name: columns.index(name) for name in (id_column, "uid", "cuid")}
        for row in rows:
            fields = row.split()
            with contextlib.suppress(ValueError, IndexError):
                if uid in (int(fields[at["uid"]]), int(fields[at["cuid"]])):
                    found.append((kind, int(fields[at[id_column]])))
    return found


def remove(kind: str, ipc_id: int) -> bool:
    """IPC_RMID; False when it was gone already (or the kernel refused)."""
    if kind == "shm":
        done = _libc.shmctl(ipc_id, IPC_RMID, None)
    elif kind == "sem":
        done = _libc.semctl(ipc_id, 0, IPC_RMID)
    else:
        done = _libc.msgctl(ipc_id, IPC_RMID, None)
    return done == 0


def remove_ipc_of(uid: int) -> int:
    """Removes every System V IPC object of `uid`; how many."""
    return sum(remove(kind, ipc_id) for kind, ipc_id in objects_of(uid))
