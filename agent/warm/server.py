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
stands in for would: an agent started as root starts it through agent.confinement.become, which becomes
that user before this module runs, so that none of that user's processes can attach to it meanwhile.

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
idle (every STALE_CHECK_SECONDS) and says so at once on the channel the agent gave it ($STALE_FD_ENV):
the agent then starts its successor while the running attempt's ranks, forked from this one, train
on, so that a restart after an edit forks from fresh code instead of waiting for fresh imports. The
agent also replaces it when the job's interpreter or environment is no longer the one it was started with.

A server of a job's imports is forked from its user's base server when that one listens and runs as it
would (agent.warm.forked): the agent asks on the base's channel, and the base forks a child that imports
only what it does not hold yet, with the base's fingerprint carried over (an edit of a file either holds
makes it stale), and serves as an exec'd one would.
"""

import contextlib
import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import NoReturn

from agent.confinement.procs import set_dumpable, set_parent_death_signal
from agent.warm.client import python_module, runs_script
from agent.warm.fresh import Fingerprint, shadowed
from agent.warm.learned import NotImports, checked_names
from agent.warm.rank import end_as_interpreter, keep, script_path

MAX_REQUEST_BYTES = 1 << 20
STALE_EXIT = 75  # its code changed under it: the agent starts a fresh one at once, not after a pause
# How often an idle server stats its modules' files (30 ms for the trainer's 2,000 on a loaded 2-core
# node): an edit is seen within this, and a successor's imports (5-20 s) start then, not at the restart.
STALE_CHECK_SECONDS = 2.0
# The agent's channel (a socket pair, agent.warm.forked): the server says there that it went stale, and the agent
# asks there for a server of more imports forked from it: {FORK_SOCKET, FORK_IMPORTS} with two descriptors, the
# forked one's own channel and its log. The forked one says its pid on its channel: {FORK_PID}.
STALE_FD_ENV = "ETT_WARM_STALE_FD"
STALE_WORD = b"s"
FORK_SOCKET, FORK_IMPORTS, FORK_PID = "socket", "imports", "pid"


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
    # attached to it (ptrace, /proc/PID/mem) would leave code running after its job. Started by root,
    # it is undumpable since it became its user (agent.confinement.become); exec'd as its user (an
    # interpreter root may not run, an agent that runs jobs as itself), from here. Its keepers
    # inherit this; each rank undoes it for itself (agent.warm.rank).
    set_dumpable(False)
    set_parent_death_signal()  # the agent gone: the server goes, and every keeper and rank with it
    if os.getppid() == 1:
        return  # the agent died before the request above took hold
    fingerprint = Fingerprint()
    with fingerprint.recording():
        for module in modules:
            importlib.import_module(module)
            del sys.modules[module]  # it runs as __main__, read afresh at each fork; what it imports stays loaded
    serve_imports(fingerprint, socket_path, modules, imports or [],
                  socket.socket(fileno=stale_fd) if stale_fd is not None else None)


def serve_imports(fingerprint: Fingerprint, socket_path: Path, modules: list[str], imports: list[str],
                  channel: socket.socket | None) -> NoReturn:
    """Imports a job's own `imports`, listens at `socket_path` and serves until stale, then exits: the start of
    every server, exec'd (serve) or forked from another (_forked_server), which carries over what that one held
    and its `fingerprint`, so that an edit of a file either holds makes it stale. `channel`: the agent's."""
    with fingerprint.recording():
        for module in imports:  # a job's own: its scripts import them again, from here
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
    listener = _listen(socket_path)
    stale = None
    while stale is None:
        ready = select.select([listener, *([channel] if channel is not None else [])], [], [], STALE_CHECK_SECONDS)[0]
        if not ready:
            stale = fingerprint.changed()  # idle: an edit seen now gets its successor started now
            continue
        if channel in ready:
            channel, stale = _agent_request(channel, listener, fingerprint, socket_path, modules)
        if listener in ready and stale is None:
            stale = _rank_request(listener, channel, fingerprint, modules, bool(imports))
    # Stale: it takes no more requests, and exits (STALE_EXIT, for the agent to start a fresh one)
    # once its keepers are gone: its exit would kill them, and the ranks of a launch forked from it.
    # A server forked from it holds all it holds, with its fingerprint: it goes stale too (within
    # STALE_CHECK_SECONDS), and this one exits once that one has, after what it forked in turn.
    print(f"agent.warm: stale ({stale} changed since this server imported it); exiting once the processes "
          "forked from it have ended", file=sys.stderr, flush=True)
    listener.close()
    socket_path.unlink(missing_ok=True)  # before the agent hears of it: its successor binds here
    if channel is not None:
        with contextlib.suppress(OSError):  # the agent gone: so is this server, by its parent-death signal
            channel.send(STALE_WORD)
        channel.close()
    with contextlib.suppress(ChildProcessError):
        os.wait()  # with SIGCHLD ignored: returns once every child has ended (wait(2))
    sys.exit(STALE_EXIT)


def _listen(socket_path: Path) -> socket.socket:
    # Bound under a name of the same length (sun_path), and put in place once listening: a socket
    # there is one that accepts (the agent takes its appearance for the end of the imports).
    bound = socket_path.with_name("." + socket_path.name[1:])
    bound.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(bound))
    os.chmod(bound, 0o600)  # whoever connects runs code as us
    listener.listen(64)
    os.rename(bound, socket_path)
    return listener


def _rank_request(listener: socket.socket, channel: socket.socket | None, fingerprint: Fingerprint,
                  modules: list[str], scripts: bool) -> str | None:
    """Serves a request at the socket: forks its keeper (agent.warm.rank). The file that made this server stale, if
    one did."""
    conn, _ = listener.accept()
    fds: list[int] = []
    stale = None
    try:
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():  # the socket is ours alone; a caller of another user is not served
            raise ValueError(f"a caller of uid {uid}")
        payload, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
        request = json.loads(payload)
        path = request.get("env", {}).get("PATH")
        if len(fds) != 3 or not serves(request["argv"], modules, scripts, path):
            raise ValueError(f"cannot serve {request.get('argv')!r} with {len(fds)} descriptors")
        stale = fingerprint.changed()  # checked here, where it forks: nothing stale is ever forked
        if stale is not None:
            raise ValueError(f"{stale} changed since this server imported it")
        shadow = shadowed(script_path(request)) if runs_script(request["argv"]) else None
        if shadow is not None:  # for this script only: a fresh interpreter imports that one
            raise ValueError(f"{shadow}, beside the script, stands in for a module this server holds")
        if os.fork() == 0:
            listener.close()
            if channel is not None:  # the agent's word, not its ranks' to forge
                channel.close()
            keep(conn, fds, request)
    except (OSError, ValueError, KeyError) as exc:
        print(f"agent.warm: request refused: {exc}", file=sys.stderr, flush=True)
    finally:
        conn.close()
        for fd in fds:
            os.close(fd)
    return stale


def _agent_request(channel: socket.socket, listener: socket.socket, fingerprint: Fingerprint, socket_path: Path,
                   modules: list[str]) -> tuple[socket.socket | None, str | None]:
    """The agent's request on its channel: a server of more imports, forked from this one (_forked_server). The
    channel (None once the agent closed it), and the file that made this server stale, if one did."""
    fds: list[int] = []
    try:
        payload, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST_BYTES, 2)
        if not payload:  # the agent closed its end: it asks nothing more here, and hears nothing more
            channel.close()
            return None, None
        request = json.loads(payload)
        imports = checked_names(request[FORK_IMPORTS])  # a job's list, learned or named: hostile input
        forked = Path(request[FORK_SOCKET])
        if len(fds) != 2 or forked.parent != socket_path.parent or forked.name == socket_path.name:
            raise ValueError(f"no server at {forked} with {len(fds)} descriptors: not beside this one's socket")
        if (stale := fingerprint.changed()) is not None:  # nothing stale is ever forked, a server no more than a rank
            print(f"agent.warm: no server forked: {stale} changed since this server imported it", file=sys.stderr,
                  flush=True)
            return channel, stale
        if os.fork() == 0:
            _forked_server(fingerprint, forked, modules, imports, fds, listener, channel)
    except (OSError, ValueError, KeyError, TypeError, NotImports) as exc:
        print(f"agent.warm: no server forked: {exc}", file=sys.stderr, flush=True)
    finally:
        for fd in fds:  # the forked one's now: its channel closes with it, at once when refused
            os.close(fd)
    return channel, None


def _forked_server(fingerprint: Fingerprint, socket_path: Path, modules: list[str], imports: list[str],
                   fds: list[int], listener: socket.socket, channel: socket.socket) -> NoReturn:
    """A server forked on the agent's request (never returns): it holds what this one imported, so it imports only
    the rest; in a session of its own and with its own log, channel and socket, as one the agent exec'd. Its
    parent-death signal makes the chain agent -> base server -> this server -> keeper -> rank."""
    def become_server() -> None:
        parent = os.getppid()
        os.setsid()
        set_parent_death_signal()
        if os.getppid() != parent:
            return  # the server it was forked from died before the request above took hold
        listener.close()  # neither the socket of the server it was forked from, nor its channel: its own
        channel.close()
        own, log = fds
        for target in (1, 2):
            os.dup2(log, target)
        os.close(log)
        sys.argv[1:] = [str(socket_path), *modules, "--imports", *imports]  # an exec'd server's, for its imports
        mine = socket.socket(fileno=own)
        mine.send(json.dumps({FORK_PID: os.getpid()}).encode())
        serve_imports(fingerprint, socket_path, modules, imports, mine)

    end_as_interpreter(become_server)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -P -m agent.warm.server SOCKET MODULE... [--imports IMPORT...]")
    args = sys.argv[2:]
    cut = args.index("--imports") if "--imports" in args else len(args)
    said = os.environ.pop(STALE_FD_ENV, None)  # before the imports: nothing they start inherits it by name
    serve(Path(sys.argv[1]), args[:cut], args[cut + 1:], int(said) if said else None)
