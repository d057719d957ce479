"""Finding and signalling every process of a worker group, wherever torchrun put it.

torchrun starts each rank in a session of its own, so no single process group holds a worker
group. Every process inherits the group's marker variable instead, and /proc tells us who has it.
The guard and the rank runners import this at every launch: os and ctypes only.
"""

import ctypes
import os
import signal

# Every process of a worker group carries this variable; a /proc scan for it finds stragglers.
GROUP_MARKER_ENV = "ETT_WORKER_GROUP"
# The attempt's cgroup (agent.confinement.cgroups), where the agent moves a process the warm server
# forks, asked at its placer's socket (agent.confinement.placement), before the process runs a line.
GROUP_CGROUP_ENV = "ETT_WORKER_CGROUP"
GROUP_PLACER_ENV = "ETT_CGROUP_PLACER"
TREE_LIMIT = 256  # processes read below a rank (process_tree)
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
_libc = ctypes.CDLL(None, use_errno=True)


def set_parent_death_signal(signum: int = signal.SIGKILL) -> None:
    """Ask the kernel for signum when our parent (the thread that forked us) dies."""
    if _libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def set_dumpable(dumpable: bool) -> None:
    """Whether processes of our own uid may attach to us (ptrace, /proc/PID/mem) and we dump core.
    Undumpable, /proc/PID is root's: only root reads our memory, maps, environment or descriptors."""
    if _libc.prctl(PR_SET_DUMPABLE, int(dumpable), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_DUMPABLE): {os.strerror(errno)}")


def marked_pids(name: str, value: str) -> list[int]:
    """Our user's live processes whose environment holds name=value."""
    needle = f"{name}={value}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ_file:
                environ = environ_file.read()
            with open(f"/proc/{name}/stat", "rb") as stat_file:
                zombie = stat_file.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue  # gone, or not ours
        if not zombie and needle in environ.split(b"\0"):
            pids.append(int(name))
    return pids


def process_uid(pid: int) -> int | None:
    """The real uid of a live process, by the kernel's word (None: gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def signal_marked(name: str, value: str, signum: int, spare: int | None = None) -> int:
    """Sends signum to every marked process but `spare`; the number signalled."""
    sent = 0
    for pid in marked_pids(name, value):
        if pid == spare:
            continue
        try:
            os.kill(pid, signum)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def cpu_and_state(pid: int) -> tuple[int, str] | None:
    """A process's CPU time so far (user + system, in clock ticks) and its state letter (R, S, D,
    T for stopped, ...), by the kernel's word; None: gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            fields = stat_file.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12]), fields[0].decode()


def process_tree(pid: int) -> list[int]:
    """The process and those below it (its children, theirs, ...), by the kernel's word: a rank started
    through a wrapper (`bash train.sh`) runs in the wrapper's child. The children each main thread
    started (`/proc/PID/task/PID/children`), where a shell, a launcher or a DataLoader starts theirs: one
    read a process, for a check made at every poll of every rank. At most TREE_LIMIT of them, so a job
    that forks thousands costs the agent no more."""
    tree, below = [], [pid]
    while below and len(tree) < TREE_LIMIT:
        current = below.pop(0)
        tree.append(current)
        try:
            with open(f"/proc/{current}/task/{current}/children", "rb") as children:
                below.extend(int(child) for child in children.read().split())
        except (OSError, ValueError):
            continue  # gone meanwhile
    return tree


def tree_cpu_and_states(pid: int) -> tuple[int, list[str]] | None:
    """The CPU time of the process and those below it together (clock ticks), and each one's state
    letter, the process's own first; None: the process is gone."""
    ticks, states = 0, []
    for index, member in enumerate(process_tree(pid)):
        vitals = cpu_and_state(member)
        if vitals is None:
            if index == 0:
                return None
            continue  # a child that ended meanwhile
        ticks += vitals[0]
        states.append(vitals[1])
    return ticks, states


def a_thread_runs_or_waits_on_io(pid: int) -> bool:
    """Whether a thread of the process, or of one below it, is runnable (R: it waits for a CPU) or in
    uninterruptible sleep (D: a page fault under memory pressure, a write to a stalled disk), by the
    kernel's word: held up by the machine, not frozen by its own code."""
    for member in process_tree(pid):
        try:
            threads = os.listdir(f"/proc/{member}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{member}/task/{tid}/stat", "rb") as stat_file:
                    if stat_file.read().rsplit(b")", 1)[1].split()[0] in (b"R", b"D"):
                        return True
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
    return False
