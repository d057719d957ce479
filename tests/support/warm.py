"""The suite's own torch processes, forked warm: one warm server (agent.warm.server, the agent's own) per
xdist worker holds torch, torchrun and the trainer, and forks the processes the tests start themselves
(the trainer's runs, the checkpoint tiers' ranks), as an agent's server forks a job's ranks.

A fresh interpreter spent 2.7 s of CPU importing torchrun and 6 s the trainer before its first line, on
a suite bound by its two cores (BENCHMARKS.md, "Twenty-eighth session"). What these processes then run is
the same code: runpy runs the module as `python -P -m MODULE` would.
"""

import atexit
import functools
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from agent.launching.launch import lean_main
from agent.warm.client import WARM_SOCKET_ENV, WarmProcess, python_module
from tests.support.processes import TEST_MARK_ENV
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
# What the server imports, each then run afresh as __main__ per request (what they import stays loaded).
SERVED = ("torch.distributed.run", "trainer.train", "tests.trainer.slow_forward",
          "tests.trainer.checkpoints.forgetful_resume", "tests.ett.checkpoints.matrix_ranks",
          "tests.ett.checkpoints.peer_ranks")


@functools.cache
def warm_socket() -> Path:
    """This worker's server, started at its first use and ended with the worker (its parent-death signal)."""
    folder = Path(tempfile.mkdtemp(prefix="ett-suite-warm-"))
    path = folder / "warm.sock"
    env = {k: v for k, v in os.environ.items() if k != TEST_MARK_ENV}  # it outlives the test that started it
    env["PYTHONPATH"] = str(REPO)  # the tests' modules, which `-P` keeps off the path
    log = open(folder / "server.log", "ab")  # noqa: SIM115 (kept open for the server's life)
    server = subprocess.Popen([*python_module(sys.executable, "agent.warm.server"), str(path), *SERVED], env=env,
                              cwd=REPO, stdout=log, stderr=log, start_new_session=True)
    atexit.register(server.kill)
    wait_for(lambda: path.exists() or server.poll() is not None, 180, "the suite's warm server to import")
    assert server.poll() is None, (folder / "server.log").read_text()
    return path


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
    """`python -m MODULE ARGS` (MODULE of SERVED), forked from this worker's server."""
    assert argv[:2] == [sys.executable, "-m"] and argv[2] in SERVED, argv
    return WarmPopen([*python_module(sys.executable, argv[2]), *argv[3:]], cwd, env, stdout, stderr)


def torchrun_command(nproc: int, master_port: int, module: str, args: list[str], control: Path) -> list[str]:
    """torchrun whose ranks are forked warm too: each through the agent's rank runner, which asks the server
    for its rank ($ETT_WARM_SOCKET: warm_env), as an agent launches them. `control`: a folder for the runners'
    records."""
    control.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(master_port), "--no-python", *lean_main(sys.executable, "agent.launching.rank_runner"),
            "--ranks-file", str(control / "ranks.jsonl"), "--control-dir", str(control), "--",
            *python_module(sys.executable, module), *args]  # fmt: skip


def warm_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for torchrun_command: the server's socket, and the tests' modules on the path of a rank that
    starts fresh after all (the server refused it: its log says why)."""
    return {**env, WARM_SOCKET_ENV: str(warm_socket()), "PYTHONPATH": str(REPO)}
