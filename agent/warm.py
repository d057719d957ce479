"""Warm start: a node's server that has imported the trainer and torchrun once, and forks them.

    python -P -m agent.warm SOCKET MODULE... [--imports IMPORT...]

A job's own Python script starts warm too when its spec names what it imports (`warm_imports`,
docs/jobspec.md): a server of its own imports those and torchrun, and forks the script's ranks
into `runpy.run_path` with them loaded (`python SCRIPT ARGS`, with the server's interpreter).

A fresh interpreter spends seconds importing torch (5-10 s on a loaded CPU node) before its first
line runs, and a restart ran two in a row: torchrun, then the ranks. The agent keeps this server
ready with MODULE... imported; the guard (for torchrun) and each rank runner (for its rank), when
the program is `python -P -m MODULE ...`, ask it over SOCKET for the process instead of starting an
interpreter, and fall back to one when the server cannot serve (agent.warm_client). The server runs
as the job's user, with the job's interpreter (agent.job_user), as the processes it stands in for
would.

Per request the server forks a keeper, which forks the process (below: the rank):
- the rank: a process group of its own, the runner's stdin/stdout/stderr (passed over the
  socket), the request's environment, cwd and argv; runs MODULE as `__main__`.
- the keeper answers the rank's pid, then how it ended (`returncode`, negative for a signal), as
  a parent does. When the runner goes (its end of the socket closes), the keeper SIGKILLs the
  rank's process group. Parent-death signals chain agent -> server -> keeper -> rank.

The server starts with one OpenMP/BLAS thread, so the imports start no thread pool (a fork copies
only the calling thread); each rank sets its own thread count. It serves the code it imported at
start: the agent restarts it (with itself) to pick up new trainer code.
"""

import contextlib
import gc
import hashlib
import importlib
import json
import logging
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path

from agent.cgroups import PROCS, NodeCgroups
from agent.job_user import RunAs
from agent.procs import GROUP_CGROUP_ENV, set_parent_death_signal
from agent.warm_client import python_module, runs_script

MAX_REQUEST_BYTES = 1 << 20
RESTART_PAUSE_SECONDS = 10.0
SOCKET_PATH_MAX_BYTES = 107  # sun_path

log = logging.getLogger(__name__)
# What the server's environment pins for the imports; a rank gets the request's values.
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def socket_path(data_dir: Path, uid: int) -> Path:
    """Where the warm server of a job user, under an agent with this data folder, listens once its
    imports are done."""
    return (data_dir / "warm" / str(uid) / "warm.sock").resolve()


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


def imports_key(imports: list[str]) -> str:
    """A short name for a set of imports: its server's socket and log."""
    return hashlib.sha1(" ".join(sorted(imports)).encode()).hexdigest()[:10]


class WarmServer:
    """The agent's handle on one job user's warm server: started, started again when it died,
    stopped. Called from the monitor loop only: the thread that forks a child owns its
    parent-death signal."""

    def __init__(self, socket_path: Path, modules: list[str], log_path: Path, run_as: RunAs = RunAs(),
                 cgroup: Path | None = None, imports: list[str] | None = None) -> None:
        self.socket_path, self.modules, self.log_path, self.run_as = socket_path, modules, log_path, run_as
        self.imports = imports or []  # a job's own imports: the server then starts its scripts
        self.cgroup = cgroup  # its user's warm/ cgroup (agent.cgroups), if the machine gives one
        self._proc: subprocess.Popen[bytes] | None = None
        self._next_start = 0.0

    @property
    def usable(self) -> bool:
        return len(os.fsencode(self.socket_path)) <= SOCKET_PATH_MAX_BYTES

    @property
    def starting(self) -> bool:
        """Started and still importing: not listening yet."""
        return self._proc is not None and self._proc.poll() is None and not self.socket_path.exists()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def ensure_running(self) -> None:
        if not self.usable or (self._proc is not None and self._proc.poll() is None):
            return
        if time.monotonic() < self._next_start:
            return
        if self._proc is not None:
            log.warning("warm server exited with code %s (see %s); starting it again", self._proc.returncode,
                        self.log_path)
        # Neither the agent's settings (its token) nor a thread pool at import time (see above).
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETT_AGENT_")} | SINGLE_THREAD_ENV
        self.run_as.make_own(self.socket_path.parent)  # the server, as the job's user, binds its socket there
        self.socket_path.unlink(missing_ok=True)  # a dead server's: `starting` waits for the new one
        with open(os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as out:
            self._proc = subprocess.Popen(
                [*python_module(self.run_as.python, "agent.warm"), str(self.socket_path), *self.modules,
                 *(["--imports", *self.imports] if self.imports else [])],
                env=env | self.run_as.env() | {"PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, **self.run_as.popen(),
            )  # fmt: skip
        if self.cgroup is not None:  # long before its imports are done and it forks anything
            (self.cgroup / PROCS).write_text(str(self._proc.pid))
        self._next_start = time.monotonic() + RESTART_PAUSE_SECONDS

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()  # keepers and ranks follow through their parent-death signals
            self._proc.wait()
        self.socket_path.unlink(missing_ok=True)


class WarmServers:
    """A warm server per job user (a server forks what it serves as its own user, and serves no
    caller of another, SO_PEERCRED), and per set of a job's own imports: the first launch of a
    user starts its server and waits for its imports, later ones fork from it. At most
    MAX_SERVERS are kept, the least recently used stopped first."""

    MAX_SERVERS = 4

    def __init__(self, data_dir: Path, modules: list[str], cgroups: NodeCgroups | None = None) -> None:
        self.data_dir, self.modules, self.cgroups = data_dir, modules, cgroups
        self._servers: dict[tuple[int, str], WarmServer] = {}  # by uid and imports, least recently used first

    def for_user(self, run_as: RunAs, imports: list[str] | None = None) -> WarmServer:
        """The user's server of the trainer, or (`imports`: a job's `warm_imports`) of its scripts."""
        uid = run_as.user.uid if run_as.user is not None else os.geteuid()
        key = (uid, imports_key(imports) if imports else "")
        server = self._servers.pop(key, None)
        if server is None:
            cgroup = None
            if self.cgroups is not None and run_as.user is not None:
                owner = self.cgroups.owner(run_as.user.uid, run_as.user.gid)
                cgroup = owner / "warm" if owner is not None else None
            sock = socket_path(self.data_dir, uid)
            if imports:  # torchrun, and the job's imports
                sock = sock.with_name(f"w-{key[1]}.sock")
            modules = ["torch.distributed.run"] if imports else self.modules
            server = WarmServer(sock, modules, self.data_dir / f"warm-{uid}{'-' + key[1] if imports else ''}.log",
                                run_as, cgroup, imports)
        self._servers[key] = server
        while len(self._servers) > self.MAX_SERVERS:
            self._servers.pop(next(iter(self._servers))).stop()
        return server

    def pids(self) -> set[int]:
        """The live servers' pids (their keepers are their children)."""
        return {pid for server in self._servers.values() if (pid := server.pid) is not None}

    def ensure_running(self) -> None:
        for server in self._servers.values():
            server.ensure_running()

    def stop(self) -> None:
        for server in self._servers.values():
            server.stop()


def serve(socket_path: Path, modules: list[str], imports: list[str] | None = None) -> None:
    set_parent_death_signal()  # the agent gone: the server goes, and every keeper and rank with it
    if os.getppid() == 1:
        return  # the agent died before the request above took hold
    for module in modules:
        importlib.import_module(module)
        del sys.modules[module]  # it runs as __main__; what it imports stays loaded
    for module in imports or []:  # a job's own: its scripts import them again, from here
        try:
            importlib.import_module(module)
        except Exception as exc:  # the script would fail as it did: this server still serves torchrun
            print(f"agent.warm: warm_imports {module}: {exc!r}", file=sys.stderr, flush=True)
    gc.collect()
    gc.freeze()  # a rank's collections then leave the imported objects' pages shared with the server
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    socket_path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(socket_path))
    os.chmod(socket_path, 0o600)  # whoever connects runs code as us
    listener.listen(64)
    while True:
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
            if os.fork() == 0:
                listener.close()
                _keep(conn, fds, request)
        except (OSError, ValueError, KeyError) as exc:
            print(f"agent.warm: request refused: {exc}", file=sys.stderr, flush=True)
        finally:
            conn.close()
            for fd in fds:
                os.close(fd)


def _keep(conn: socket.socket, fds: list[int], request: dict) -> None:
    """The keeper: the rank's parent. Never returns."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        server, keeper = os.getppid(), os.getpid()
        set_parent_death_signal()
        if os.getppid() != server:
            return  # the server died before the request above took hold
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run_rank(fds, request, keeper)
        with contextlib.suppress(OSError):  # here too, so the group exists before the rank runs a line
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
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


def _run_rank(fds: list[int], request: dict, keeper: int) -> None:
    """The rank, in the keeper's child: becomes what `python -m MODULE ARGS` would be. Never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        set_parent_death_signal()
        if os.getppid() != keeper:
            return  # the keeper died before the request above took hold
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        cgroup = os.environ.get(GROUP_CGROUP_ENV)
        if cgroup:  # into the attempt's cgroup before a line of it runs: it is emptied at the end
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
                procs.write("0")
        os.chdir(request["cwd"])
        if "torch" in sys.modules:  # what OMP_NUM_THREADS would have set in a fresh interpreter
            threads = os.environ.get("OMP_NUM_THREADS")
            sys.modules["torch"].set_num_threads(int(threads) if threads else len(os.sched_getaffinity(0)))
        argv = request["argv"]
        if runs_script(argv):  # a job's script: `python SCRIPT ARGS`, its folder first on the path
            sys.argv = argv[1:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
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


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -P -m agent.warm SOCKET MODULE... [--imports IMPORT...]")
    args = sys.argv[2:]
    cut = args.index("--imports") if "--imports" in args else len(args)
    serve(Path(sys.argv[1]), args[:cut], args[cut + 1:])
