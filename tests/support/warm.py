"""The suite's own torch processes, forked warm: one warm server (agent.warm.server, the agent's own) per
xdist worker holds torch, torchrun and the trainer, and forks the processes the tests start themselves
(the trainer's runs, the checkpoint tiers' ranks, the library's plain-DDP and FSDP2 runs), as an agent's
server forks a job's ranks. A reference for what a user's plain torchrun computes stays a fresh one.

A fresh interpreter spent 2.7 s of CPU importing torchrun and 6 s the trainer before its first line, on
a suite bound by its two cores (BENCHMARKS.md, "Twenty-eighth session"). What these processes then run is
the same code: runpy runs the module as `python -P -m MODULE` would.
"""

import atexit
import functools
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from agent.launching.launch import lean_main
from agent.warm.client import WARM_SOCKET_ENV, WarmProcess, python_module
from agent.warm.servers import SCRIPT_BASE_IMPORTS
from tests.support.postgres import free_port
from tests.support.processes import TEST_MARK_ENV
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
# What the server imports, each then run afresh as __main__ per request (what they import stays loaded). It
# also holds what every script on our library loads (an agent's base server's), and starts `python SCRIPT.py`.
SERVED = ("torch.distributed.run", "trainer.train", "tests.trainer.slow_forward",
          "tests.trainer.checkpoints.forgetful_resume", "tests.ett.checkpoints.matrix_ranks",
          "tests.ett.checkpoints.peer_ranks", "tests.ett.fsdp_ranks")


_starting = threading.Lock()  # two threads of a test asking at once start one server


def warm_socket() -> Path:
    """This worker's server, started at its first use and ended with the worker."""
    with _starting:
        return _started()


@functools.cache
def _started() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="ett-suite-warm-"))
    path, started = folder / "warm.sock", queue.Queue()
    # Its parent-death signal comes when the thread that started it ends (prctl(2)), not the worker: a test's
    # thread pool that asked first took it down with it. So a thread of its own starts it, and lives on.
    threading.Thread(target=_keep_server, args=(folder, path, started), daemon=True, name="suite-warm-server").start()
    server = started.get()
    wait_for(lambda: path.exists() or server.poll() is not None, 180, "the suite's warm server to import")
    assert server.poll() is None, (folder / "server.log").read_text()
    return path


def _keep_server(folder: Path, path: Path, started: queue.Queue) -> None:
    env = {k: v for k, v in os.environ.items() if k != TEST_MARK_ENV}  # it outlives the test that started it
    env["PYTHONPATH"] = str(REPO)  # the tests' modules, which `-P` keeps off the path
    with open(folder / "server.log", "ab") as log:
        server = subprocess.Popen([*python_module(sys.executable, "agent.warm.server"), str(path), *SERVED,
                                   "--imports", *SCRIPT_BASE_IMPORTS], env=env, cwd=REPO, stdout=log, stderr=log,
                                  start_new_session=True)  # fmt: skip
    atexit.register(server.kill)
    started.put(server)
    threading.Event().wait()  # for as long as the worker runs


class WarmPopen:
    """A process the warm server forked: the calls of subprocess.Popen the suite makes. Its rank is the child of
    a keeper, which SIGKILLs it when this handle's connection closes (a test that ended without waiting)."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], stdout: int, stderr: int) -> None:
        with open(os.devnull, "rb") as stdin:
            self._process = WarmProcess(str(warm_socket()), argv, [stdin.fileno(), stdout, stderr], env, str(cwd))
        self.pid, self.args, self.returncode = self._process.pid, argv, None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._process], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._process], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = self._process.wait()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            self._process.send_signal(signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: list[str], cwd: Path, env: dict[str, str], stdout: int, stderr: int) -> WarmPopen:
    """`python -m MODULE ARGS` (MODULE of SERVED) or `python SCRIPT.py ARGS`, forked from this worker's server."""
    return WarmPopen(_as_served(argv), cwd, env, stdout, stderr)


def torchrun(nproc: int, rank_argv: list[str], control: Path, cwd: Path, env: dict[str, str], stdout: int,
             stderr: int) -> WarmPopen:
    """torchrun of `nproc` ranks of `rank_argv` (as start's), itself and its ranks forked warm: each rank through
    the agent's rank runner, which asks the server for it ($ETT_WARM_SOCKET), as an agent launches them.
    `control`: a folder for the runners' records."""
    control.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "--no-python", *lean_main(sys.executable, "agent.launching.rank_runner"),
               "--ranks-file", str(control / "ranks.jsonl"), "--control-dir", str(control), "--", *_as_served(rank_argv)]
    # The tests' modules on the path of a rank that starts fresh after all (the server refused it: its log says why).
    env = {**env, WARM_SOCKET_ENV: str(warm_socket()), "PYTHONPATH": str(REPO)}
    return start(command, cwd, env, stdout, stderr)  # fmt: skip


def _as_served(argv: list[str]) -> list[str]:
    """A request the server serves: `python -m MODULE` as `python -P -m MODULE`; a script as it is."""
    assert argv[0] == sys.executable, argv
    if argv[1] != "-m":
        assert argv[1].endswith(".py"), argv
        return argv
    assert argv[2] in SERVED, f"{argv[2]} is not among the modules of the suite's warm server (SERVED)"
    return [*python_module(sys.executable, argv[2]), *argv[3:]]
