"""Warm start: a node's server that has imported the trainer and torchrun once, and forks them.

    python -P -m agent.warm.server SOCKET MODULE... [--imports IMPORT...]

A job's own Python script starts warm too when its spec names what it imports (`warm_imports`,
docs/jobspec.md): a server of its own imports those and torchrun, and forks the script's ranks
into `runpy.run_path` with them loaded (`python SCRIPT ARGS`, with the server's interpreter).

A fresh interpreter spends seconds importing torch (5-10 s on a loaded CPU node) before its first
line runs, and a restart ran two in a row: torchrun, then the ranks. The agent (agent.warm.servers)
keeps this server ready with MODULE... imported; the guard (for torchrun) and each rank runner (for
its rank), when the program is `python -P -m MODULE ...`, ask it over SOCKET for the process instead
of starting an interpreter, and fall back to one when the server cannot serve (agent.warm.client).
The server runs as the job's user, with the job's interpreter (agent.confinement.job_user), as the processes it
stands in for would.

Per request the server forks a keeper, which forks the process (below: the rank):
- the rank: a process group of its own, the runner's stdin/stdout/stderr (passed over the
  socket), the request's environment, cwd and argv; moved by the agent into its attempt's cgroup
  (agent.confinement.placement), then runs MODULE as `__main__`.
- the keeper answers the rank's pid once it is placed (else nothing: the asker starts it fresh),
  then how it ended (`returncode`, negative for a signal), as
  a parent does. When the runner goes (its end of the socket closes), the keeper SIGKILLs the
  rank's process group. Parent-death signals chain agent -> server -> keeper -> rank.

The server starts with one OpenMP/BLAS thread, so the imports start no thread pool (a fork copies
only the calling thread); each rank sets its own thread count. It never forks stale code
(agent.warm.fresh): once a file of a module it holds has changed since it imported it, it refuses
that request and every later one (the asker starts a fresh interpreter), and exits (STALE_EXIT)
when what it forked has ended, for the agent to start a fresh server at once. It also looks while
idle (every STALE_CHECK_SECONDS) and says so at once on the pipe the agent gave it ($STALE_FD_ENV):
the agent then starts its successor while the running attempt's ranks, forked from this one, train
on, so that a restart after an edit forks from fresh code instead of waiting for fresh imports. The
agent also replaces it when the job's interpreter or environment is no longer the one it was started with.
"""

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path

from agent.confinement.placement import ask_to_be_placed
from agent.confinement.procs import GROUP_CGROUP_ENV, GROUP_PLACER_ENV, set_dumpable, set_parent_death_signal
from agent.warm.client import python_module, runs_script
from agent.warm.fresh import Fingerprint, shadowed

MAX_REQUEST_BYTES = 1 << 20
STALE_EXIT = 75  # its code changed under it: the agent starts a fresh one at once, not after a pause
# How often an idle server stats its modules' files (30 ms for the trainer's 2,000 on a loaded 2-core
# node): an edit is seen within this, and a successor's imports (5-20 s) start then, not at the restart.
STALE_CHECK_SECONDS = 2.0
STALE_FD_ENV = "ETT_WARM_STALE_FD"  # the pipe on which it tells the agent it went stale (agent.warm.servers)
STALE_WORD = b"s"


def serves(argv: list[str], modules: list[str], scripts: bool = False, path: str | None = None) -> bool:
    """Whether this server can start `argv`: `python -P -m MODULE` of its modules, or, for a server
    of a job's imports (`scripts`), `python SCRIPT.py ...` whose python (on the request's PATH) is
    this interpreter."""
    if len(argv) >= 4 and argv[:4] == python_module(sys.executable, argv[3]) and argv[3] in modules:
        return True
    if not scripts or not runs_script(argv):
        return False
    python = shutil.which(argv[0], path=path)
    return python is not None and os.path.realpath(python) == os.path.realpath(sys.executable)


def serve(socket_path: Path, modules: list[str], imports: list[str] | None = None, stale_fd: int | None = None
          ) -> None:
    # It outlives its user's jobs (the sweep spares it and its keepers): a rank of that user that
    # attached to it (ptrace, /proc/PID/mem) would leave code running after its job. Its keepers
    # inherit this; each rank undoes it for itself (_run_rank).
    set_dumpable(False)
    set_parent_death_signal()  # the agent gone: the server goes, and every keeper and rank with it
    if os.getppid() == 1:
        return  # the agent died before the request above took hold
    fingerprint = Fingerprint()
    with fingerprint.recording():
        for module in modules:
            importlib.import_module(module)
            del sys.modules[module]  # it runs as __main__, read afresh at each fork; what it imports stays loaded
        for module in imports or []:  # a job's own: its scripts import them again, from here
            try:
                importlib.import_module(module)
            except Exception as exc:  # the script would fail as it did: this server still serves torchrun
                print(f"agent.warm: warm_imports {module}: {exc!r}", file=sys.stderr, flush=True)
    fingerprint.changed()  # records the files not seen loading: extension modules, the interpreter
    gc.collect()
    gc.freeze()  # a rank's collections then leave the imported objects' pages shared with the server
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    # A SIGTERM to the whole tree (Slurm's preemption, a service manager's stop) is for the ranks to
    # act on: the server and its keepers would die of it, and take what they forked with them by
    # its parent-death signal (SIGKILL) before a final checkpoint. The agent stops them with SIGKILL.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Bound under a name of the same length (sun_path), and put in place once listening: a socket
    # there is one that accepts (the agent takes its appearance for the end of the imports).
    bound = socket_path.with_name("." + socket_path.name[1:])
    bound.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(bound))
    os.chmod(bound, 0o600)  # whoever connects runs code as us
    listener.listen(64)
    os.rename(bound, socket_path)
    stale = None
    while stale is None:
        if not select.select([listener], [], [], STALE_CHECK_SECONDS)[0]:
            stale = fingerprint.changed()  # idle: an edit seen now gets its successor started now
            continue
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():  # the socket is ours alone; a caller of another user is not served
                raise ValueError(f"a caller of uid {uid}")
            payload, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
            request = json.loads(payload)
            path = request.get("env", {}).get("PATH")
            if len(fds) != 3 or not serves(request["argv"], modules, bool(imports), path):
                raise ValueError(f"cannot serve {request.get('argv')!r} with {len(fds)} descriptors")
            stale = fingerprint.changed()  # checked here, where it forks: nothing stale is ever forked
            if stale is not None:
                raise ValueError(f"{stale} changed since this server imported it")
            shadow = shadowed(script_path(request)) if runs_script(request["argv"]) else None
            if shadow is not None:  # for this script only: a fresh interpreter imports that one
                raise ValueError(f"{shadow}, beside the script, stands in for a module this server holds")
            if os.fork() == 0:
                listener.close()
                if stale_fd is not None:  # the agent's word, not its ranks' to forge
                    os.close(stale_fd)
                _keep(conn, fds, request)
        except (OSError, ValueError, KeyError) as exc:
            print(f"agent.warm: request refused: {exc}", file=sys.stderr, flush=True)
        finally:
            conn.close()
            for fd in fds:
                os.close(fd)
    # Stale: it takes no more requests, and exits (STALE_EXIT, for the agent to start a fresh one)
    # once its keepers are gone: its exit would kill them, and the ranks of a launch forked from it.
    print(f"agent.warm: stale ({stale} changed since this server imported it); exiting once the processes "
          "forked from it have ended", file=sys.stderr, flush=True)
    listener.close()
    socket_path.unlink(missing_ok=True)  # before the agent hears of it: its successor binds here
    if stale_fd is not None:
        with contextlib.suppress(OSError):  # the agent gone: so is this server, by its parent-death signal
            os.write(stale_fd, STALE_WORD)
        os.close(stale_fd)
    with contextlib.suppress(ChildProcessError):
        os.wait()  # with SIGCHLD ignored: returns once every child has ended (wait(2))
    sys.exit(STALE_EXIT)


def script_path(request: dict) -> str:
    """A request's `python SCRIPT`, absolute: its folder is the first on a fresh interpreter's path."""
    return os.path.abspath(os.path.join(request["cwd"], request["argv"][1]))


def _keep(conn: socket.socket, fds: list[int], request: dict) -> None:
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
            _run_rank(fds, request, keeper, placed_write)
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


def _run_rank(fds: list[int], request: dict, keeper: int, placed: int) -> None:
    """The rank, in the keeper's child: becomes what `python -m MODULE ARGS` would be, once in its
    attempt's cgroup (then it writes a byte to `placed`, for its keeper). Never returns."""
    code = 1
    try:
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
        code = 0
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


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -P -m agent.warm.server SOCKET MODULE... [--imports IMPORT...]")
    args = sys.argv[2:]
    cut = args.index("--imports") if "--imports" in args else len(args)
    said = os.environ.pop(STALE_FD_ENV, None)  # before the imports: nothing they start inherits it by name
    serve(Path(sys.argv[1]), args[:cut], args[cut + 1:], int(said) if said else None)
