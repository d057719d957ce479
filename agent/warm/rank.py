"""What a warm server (agent.warm.server) forks per request: the keeper, and the rank it stands in for."""

import contextlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from agent.confinement.placement import ask_to_be_placed
from agent.confinement.procs import GROUP_CGROUP_ENV, GROUP_PLACER_ENV, set_dumpable, set_parent_death_signal
from agent.warm.client import runs_script


def script_path(request: dict) -> str:
    """A request's `python SCRIPT`, absolute: its folder is the first on a fresh interpreter's path."""
    return os.path.abspath(os.path.join(request["cwd"], request["argv"][1]))


def keep(conn: socket.socket, fds: list[int], request: dict) -> None:
    """The keeper: the rank's parent. Never returns."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        server, keeper = os.getppid(), os.getpid()
        set_parent_death_signal()
        if os.getppid() != server:
            return  # the server died before the request above took hold
        placed_read, placed_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            conn.close()
            os.close(placed_read)
            end_as_interpreter(lambda: _run_rank(fds, request, keeper, placed_write))
        os.close(placed_write)
        with contextlib.suppress(OSError):  # here too, so the group exists before the rank runs a line
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
        # Its pid goes to the asker only once it is in its attempt's cgroup; a rank that could not be
        # placed has run nothing and exits, and the asker, answered nothing, starts a fresh process.
        placed = os.read(placed_read, 1) == b"1"
        os.close(placed_read)
        if not placed:
            os.waitpid(pid, 0)
            return
        conn.sendall(json.dumps({"pid": pid}).encode())
        pidfd = os.pidfd_open(pid)
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd not in ready:  # the runner is gone: so is the rank
            os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
    except OSError:
        pass
    finally:
        os._exit(0)


def _run_rank(fds: list[int], request: dict, keeper: int, placed: int) -> int | None:
    """The rank, in the keeper's child (under end_as_interpreter): becomes what `python -m MODULE ARGS`
    would be, once in its attempt's cgroup (then it writes a byte to `placed`, for its keeper); 0 once
    its code has run, None where it must not run."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's SIG_IGN is not the rank's
    set_parent_death_signal()
    if os.getppid() != keeper:
        return  # the keeper died before the request above took hold
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    # Its asker's folder, as a fresh process inherits it; one its user may not enter (a Slurm
    # step's, under root's folders) leaves it unplaced: the asker starts a fresh process there.
    try:
        os.chdir(request["cwd"])
    except OSError:
        os._exit(1)  # nothing ran, nothing said in its output
    _enter_cgroup()
    os.write(placed, b"1")
    os.close(placed)
    # Dumpable again, as a fresh interpreter would be: its user may debug its own rank (py-spy,
    # gdb, a core dump), and without cgroups the agent knows its ranks by the owner of /proc/PID
    # (WorkerGroup.owns). Only now that it is in its attempt's cgroup, which its end empties;
    # its keeper and server stay undumpable.
    set_dumpable(True)
    if "torch" in sys.modules:  # what OMP_NUM_THREADS would have set in a fresh interpreter
        threads = os.environ.get("OMP_NUM_THREADS")
        sys.modules["torch"].set_num_threads(int(threads) if threads else len(os.sched_getaffinity(0)))
    argv = request["argv"]
    if runs_script(argv):  # a job's script: `python SCRIPT ARGS`, its folder first on the path
        sys.argv = argv[1:]
        sys.path.insert(0, os.path.dirname(script_path(request)))
        runpy.run_path(argv[1], run_name="__main__")
    else:
        sys.argv = [argv[0], *argv[4:]]
        runpy.run_module(argv[3], run_name="__main__", alter_sys=True)
    return 0


def end_as_interpreter(body: Callable[[], int | None]) -> NoReturn:
    """Runs `body` in a forked child and ends the process as an interpreter ending it would, never
    returning into the code it was forked from: its SystemExit's code, a traceback and 1 for any other
    exception, 1 where `body` returns None (it stopped before its work), its output flushed."""
    code = 1
    try:
        returned = body()
        code = 1 if returned is None else returned
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _enter_cgroup() -> None:
    """Into the attempt's cgroup (the request's), which is emptied at its end, before a line of it
    runs: the agent moves it (agent.confinement.placement); an agent without a placer has it move
    itself, which only root may (a job user writes no cgroup.procs)."""
    cgroup = os.environ.get(GROUP_CGROUP_ENV)
    if not cgroup:
        return
    placer = os.environ.get(GROUP_PLACER_ENV)
    try:
        if placer:
            ask_to_be_placed(placer, cgroup)
        else:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
                procs.write("0")
    except OSError as exc:
        print(f"agent.warm: not in the attempt's cgroup ({exc}); a fresh process starts instead", file=sys.stderr,
              flush=True)
        os._exit(1)

