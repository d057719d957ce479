"""The agent's side of warm start: a warm server (agent.warm.server) per job user and set of imports,
started, started again when it died or went stale, replaced when the job's interpreter or
environment is no longer the one it was started with, stopped."""

import hashlib
import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from agent.confinement.cgroup_end import PROCS
from agent.confinement.cgroups import NodeCgroups
from agent.confinement.job_user import RunAs
from agent.warm.client import python_module
from agent.warm.forked import ForkedServer, channel_pair, fork_server
from agent.warm.server import STALE_EXIT, STALE_FD_ENV, STALE_WORD
from agent.warm.sockets import SOCKET_PATH_MAX_BYTES

RESTART_PAUSE_SECONDS = 10.0
# Stale servers kept for what they forked, at most, per server: an edit retires one, and a successor
# with nothing forked exits at once when it goes stale too. Past it, a word on its channel waits there
# (a module of the job's, imported in the server as its user, could write it): at most this many more
# processes, and the stale one is replaced when it exits, as before.
MAX_RETIRED = 2

log = logging.getLogger(__name__)
# What every PyTorch script on ETT's library loads, whatever else it imports (the plain DDP example's
# own `warm_imports`, examples/jobs/plain_ddp.toml): a script that names none forks from a server of
# these from its first launch on, and later from the server of what it imported once that one listens.
SCRIPT_BASE_IMPORTS = ["torch.nn.parallel", "ett.run"]
# What the server's environment pins for the imports; a rank gets the request's values.
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def socket_path(folder: Path, uid: int) -> Path:
    """Where the warm server of a job user listens once its imports are done (`folder`: socket_folder's)."""
    return folder / str(uid) / "warm.sock"


def imports_key(imports: list[str]) -> str:
    """A short name for a set of imports: its server's socket and log."""
    return hashlib.sha1(" ".join(sorted(imports)).encode()).hexdigest()[:10]


class WarmServer:
    """The agent's handle on one job user's warm server: started, started again when it died (at
    once when it went stale), stopped. Called from the monitor loop only: the thread that forks a child owns its
    parent-death signal. A server that says it went stale while what it forked runs on (a module it
    holds was edited under a running attempt) is retired: kept until that ends, while its successor
    starts importing at once, on the same socket path."""

    def __init__(self, socket_path: Path, modules: list[str], log_path: Path, run_as: RunAs = RunAs(),
                 cgroup: Path | None = None, imports: list[str] | None = None) -> None:
        self.socket_path, self.modules, self.log_path, self.run_as = socket_path, modules, log_path, run_as
        self.imports = imports or []  # a job's own imports: the server then starts its scripts
        self.cgroup = cgroup  # its user's warm/ cgroup (agent.confinement.cgroups), if the machine gives one
        self._proc: subprocess.Popen[bytes] | ForkedServer | None = None
        self._stale_pipe: int | None = None  # the agent's end of the running one's channel (agent.warm.forked)
        self._retired: list[subprocess.Popen[bytes] | ForkedServer] = []  # stale ones, until what they forked ended
        self.base: Callable[[], WarmServer | None] = lambda: None  # its user's base server, to fork it from
        self._next_start = 0.0
        self._env: dict[str, str] | None = None  # what it was started with
        self._trouble: str | None = None  # why its last start failed (its folder is its user's to fill)

    def environment(self) -> dict[str, str]:
        """What it starts with: the job's processes' own, with no thread pool at import time (above)."""
        return self.run_as.base_env() | SINGLE_THREAD_ENV | {"PYTHONUNBUFFERED": "1"}

    def serves_job(self, run_as: RunAs) -> bool:
        """Whether it runs as a job of `run_as` would: that interpreter and user, and the environment
        it would be started with now (variables read at import took effect there, not in the job)."""
        return run_as == self.run_as and self._env in (None, self.environment())

    @property
    def usable(self) -> bool:
        """Whether launches may fork from it; if not, they start fresh."""
        return self._socket_fits and self._trouble is None

    @property
    def _socket_fits(self) -> bool:
        return len(os.fsencode(self.socket_path)) <= SOCKET_PATH_MAX_BYTES

    @property
    def starting(self) -> bool:
        """Started and not listening: still importing (or stale, waiting for what it forked to end)."""
        return self._proc is not None and self._proc.poll() is None and not self.socket_path.exists()

    @property
    def listening(self) -> bool:
        """Running with its imports done: a launch may fork from it now."""
        return self._proc is not None and self._proc.poll() is None and self.socket_path.exists()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def forked_from(self) -> set[Path]:
        """The sockets of the servers its live processes were forked from: stopping one ends them."""
        return {proc.base for proc in [self._proc, *self._retired]
                if isinstance(proc, ForkedServer) and proc.poll() is None}

    @property
    def pids(self) -> set[int]:
        """The live server's and its retired predecessors' (their keepers are their children)."""
        return {proc.pid for proc in [self._proc, *self._retired] if proc is not None and proc.poll() is None}

    def ensure_running(self) -> None:
        """Starts it if it is not running (and its pause after a failed start is over). What its
        user left in its folder (a folder where the socket goes, say) stops this server from
        starting, never the agent: its launches start fresh meanwhile."""
        try:
            self._ensure_running()
        except OSError as exc:
            if self._trouble is None:
                log.warning("warm server %s not started: %s; its user's launches start fresh", self.socket_path, exc)
            self._trouble, self._next_start = str(exc), time.monotonic() + RESTART_PAUSE_SECONDS

    def _ensure_running(self) -> None:
        self._retired = [proc for proc in self._retired if proc.poll() is None]
        if self._proc is not None and len(self._retired) < MAX_RETIRED and self._said_stale():
            log.info("warm server %s: a module it held changed (see %s); a fresh one starts now, the old one exits "
                     "once what it forked has ended", self.socket_path, self.log_path)
            self._retired.append(self._proc)
            self._proc, self._next_start = None, 0.0
        if not self._socket_fits or (self._proc is not None and self._proc.poll() is None):
            return
        stale = self._proc is not None and self._proc.returncode == STALE_EXIT
        if time.monotonic() < self._next_start and not stale:
            return
        if stale:
            log.info("warm server %s: a module it held changed (see %s); starting a fresh one", self.socket_path,
                     self.log_path)
        elif self._proc is not None:
            log.warning("warm server exited with code %s (see %s); starting it again", self._proc.returncode,
                        self.log_path)
        self._env = self.environment()
        self.run_as.make_own(self.socket_path.parent)  # the server, as the job's user, binds its socket there
        self.socket_path.unlink(missing_ok=True)  # a dead server's: `starting` waits for the new one
        self._close_stale_pipe()
        if not self._fork_from_base():
            self._start_fresh()
        if self.cgroup is not None:  # long before its imports are done and it forks anything
            try:
                (self.cgroup / PROCS).write_text(str(self._proc.pid))
            except OSError:  # outside its cgroup, what it forked could be placed nowhere: none of it
                self.stop()
                raise
        self._next_start, self._trouble = time.monotonic() + RESTART_PAUSE_SECONDS, None

    def _fork_from_base(self) -> bool:
        """Forks it from its user's base server if that one listens, holds the same modules and runs as this one would
        (user, interpreter, environment): it then imports only what the base does not hold, not torch again
        (agent.warm.forked), in the base's cgroup, its user's warm/ one. False, nothing started, where it may not or
        the base refused: it starts fresh."""
        base = self.base()
        if (base is None or base is self or base.modules != self.modules or not base.listening or base.pid is None
                or base._stale_pipe is None or not base.serves_job(self.run_as)):
            return False
        try:
            forked = fork_server(base._stale_pipe, base.socket_path, base.pid, self.socket_path, self.imports,
                                 self.log_path)
        except OSError as exc:
            log.info("warm server %s: not forked from %s (%s); a fresh interpreter starts it", self.socket_path.name,
                     base.socket_path.name, exc)
            return False
        self._proc, self._stale_pipe = forked, forked.stale_fd()
        log.info("warm server %s forked from %s (pid %d); it imports what that one does not hold",
                 self.socket_path.name, base.socket_path.name, forked.pid)
        return True

    def _start_fresh(self) -> None:
        """An interpreter exec'd for it, which imports all it holds."""
        said, tell = channel_pair()
        os.set_blocking(said, False)
        try:
            with open(os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as out:
                argv, as_user = self.run_as.start_kept(  # never dumpable as its user (RunAs.start_kept)
                    [*python_module(self.run_as.python, "agent.warm.server"), str(self.socket_path), *self.modules,
                     *(["--imports", *self.imports] if self.imports else [])])
                self._proc = subprocess.Popen(
                    argv, env=self._env | {STALE_FD_ENV: str(tell)}, pass_fds=(tell,), stdin=subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **as_user,
                )  # fmt: skip
        except BaseException:
            os.close(said)
            raise
        finally:
            os.close(tell)
        self._stale_pipe = said

    def _said_stale(self) -> bool:
        """Whether the running server said it went stale: it listens no more (its socket is gone), and
        exits once what it forked has ended. Its channel, which nothing it forks holds: no job can say it."""
        if self._stale_pipe is None or self._proc is None or self._proc.poll() is not None:
            return False
        try:
            return os.read(self._stale_pipe, 1) == STALE_WORD
        except BlockingIOError:
            return False

    def _close_stale_pipe(self) -> None:
        if self._stale_pipe is not None:
            os.close(self._stale_pipe)
            self._stale_pipe = None

    def stop(self) -> None:
        for proc in [self._proc, *self._retired]:
            if proc is not None and proc.poll() is None:
                proc.kill()  # keepers and ranks follow through their parent-death signals
                proc.wait()
        self._retired = []
        self._close_stale_pipe()
        try:
            self.socket_path.unlink(missing_ok=True)
        except OSError as exc:  # its user's folder: whatever lies there is left there
            log.warning("warm server %s: socket not removed: %s", self.socket_path, exc)


class WarmServers:
    """A warm server per job user (a server forks what it serves as its own user, and serves no
    caller of another, SO_PEERCRED), and per set of a job's own imports: the first launch of a
    user starts its server and waits for its imports, later ones fork from it. At most
    MAX_SERVERS are kept, the least recently used stopped first; one that servers forked from it
    hold is not (they would end with it: WarmServer._fork_from_base)."""

    MAX_SERVERS = 4

    def __init__(self, data_dir: Path, modules: list[str], cgroups: NodeCgroups | None = None,
                 sockets: Path | None = None) -> None:
        self.data_dir, self.modules, self.cgroups = data_dir, modules, cgroups
        self.sockets = sockets or (data_dir / "warm").resolve()  # socket_folder's
        self._servers: dict[tuple[int, str], WarmServer] = {}  # by uid and imports, least recently used first

    def kept(self, run_as: RunAs, imports: list[str] | None = None) -> WarmServer | None:
        """The server for_user would give, if one is kept and runs as this job would; None, and
        nothing started or reordered, else."""
        server = self._servers.get(self._key(run_as, imports))
        return server if server is not None and server.serves_job(run_as) else None

    def for_user(self, run_as: RunAs, imports: list[str] | None = None, busy: frozenset[Path] = frozenset()
                 ) -> WarmServer:
        """The user's server of the trainer, or (`imports`: a job's `warm_imports`) of its scripts,
        a fresh one if it no longer runs as this job would. `busy`: the sockets the node's running
        groups forked from, whose servers are never stopped here (their keepers and ranks would go
        with them); any other may be, as the least recently used or as no longer the job's."""
        uid = run_as.user.uid if run_as.user is not None else os.geteuid()
        key = self._key(run_as, imports)
        busy = busy | {base for kept in self._servers.values() if kept.socket_path in busy for base in kept.forked_from}
        server = self._servers.pop(key, None)
        if server is not None and not server.serves_job(run_as) and server.socket_path in busy:
            # A running group's (only a warm command or a learned list asks while one runs, and a
            # launch waits for the group's end): replaced at the next launch, after that end.
            self._servers[key] = server
            return server
        if server is not None and not server.serves_job(run_as):  # replaced: a fresh one of the job's
            log.info("warm server %s: the job's interpreter or environment changed; starting a fresh one",
                     server.socket_path)
            server.stop()
            server = None
        if server is None:
            cgroup = None
            if self.cgroups is not None and run_as.user is not None:
                owner = self.cgroups.owner(run_as.user.uid)
                cgroup = owner / "warm" if owner is not None else None
            sock = socket_path(self.sockets, uid)
            if imports:  # torchrun, and the job's imports
                sock = sock.with_name(f"w-{key[1]}.sock")
            modules = ["torch.distributed.run"] if imports else self.modules
            server = WarmServer(sock, modules, self.data_dir / f"warm-{uid}{'-' + key[1] if imports else ''}.log",
                                run_as, cgroup, imports)
            if imports and key[1] != imports_key(SCRIPT_BASE_IMPORTS):
                server.base = lambda: self.kept(run_as, SCRIPT_BASE_IMPORTS)
        self._servers[key] = server
        held = busy | {base for kept in self._servers.values() for base in kept.forked_from}
        idle = [k for k, kept in self._servers.items() if kept is not server and kept.socket_path not in held]
        for old in idle[:max(0, len(self._servers) - self.MAX_SERVERS)]:  # least recently used first
            self._servers.pop(old).stop()
        return server

    @staticmethod
    def _key(run_as: RunAs, imports: list[str] | None) -> tuple[int, str]:
        uid = run_as.user.uid if run_as.user is not None else os.geteuid()
        return (uid, imports_key(imports) if imports else "")

    def pids(self) -> set[int]:
        """The live servers' pids (their keepers are their children)."""
        return {pid for server in self._servers.values() for pid in server.pids}

    def ensure_running(self) -> None:
        for server in self._servers.values():
            server.ensure_running()

    def stop(self) -> None:
        for server in self._servers.values():
            server.stop()
