"""Launch the real trainer (torchrun or one plain process), read its event spools, and signal
its ranks the way the agent does: on seeing a given event."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ett.protocol import EVENTS_DIR, RANK_SPOOL_GLOB, rank_spool
from tests.support import warm
from tests.support.postgres import free_port
from tests.support.warm import WarmPopen

REPO = Path(__file__).resolve().parents[2]
STDERR_LOG = "stderr.log"  # in a run's workdir: what its processes wrote on stderr
# Dropout draws from each rank's generator every step: an exact resume needs the generators restored.
TINY_EP_ZERO3 = ["--preset", "tiny", "--parallel.ep", "2", "--parallel.zero", "3", "--model.dropout", "0.1"]


@dataclass
class TrainerRun:
    returncode: int
    stderr: str
    event_dir: Path
    checkpoint_dir: Path

    def events(self, rank: int = 0) -> list[dict]:
        return read_events(self.event_dir / rank_spool(rank))

    def losses(self) -> dict[int, float]:
        return {e["step"]: e["data"]["loss"] for e in self.events(0) if e["kind"] == "step"}


def local_checkpoint_dir(workdir: Path) -> Path:
    """Where a run in workdir keeps its node-local checkpoint copies, when it has them."""
    return workdir / "local-ckpt"


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def launch(workdir: Path, args: list[str], nproc: int | None, checkpoint_dir: Path | None, attempt: int,
           module: str = "trainer.train", env: dict[str, str] | None = None, fresh: bool = False
           ) -> tuple[WarmPopen | subprocess.Popen, Path, Path]:
    """nproc ranks under torchrun, or one plain `python -m trainer.train` when nproc is None, forked from the
    suite's warm server (tests/support/warm.py); `module`: the trainer, or a test's wrapper of it; `env`:
    variables added to the ranks'. What they write on stderr goes to workdir/stderr.log. `fresh`: under plain
    torchrun, every process a fresh interpreter: a reference for what an agent's warm ranks compute."""
    event_dir, checkpoint_dir = workdir / EVENTS_DIR, checkpoint_dir or workdir / "ckpt"
    env = {**os.environ, "ETT_EVENT_DIR": str(event_dir), "ETT_ATTEMPT": str(attempt), "OMP_NUM_THREADS": "1",
           **(env or {})}
    command = [sys.executable, "-m", module, "--checkpoint.dir", str(checkpoint_dir), *args]
    workdir.mkdir(parents=True, exist_ok=True)
    with open(os.devnull, "w") as stdout, open(workdir / STDERR_LOG, "w") as stderr:
        if fresh:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc or 1),
                        "--master-port", str(free_port())]
            process = subprocess.Popen([*torchrun, *command[1:]], cwd=REPO, env=env, stdout=stdout, stderr=stderr,
                                       start_new_session=True)  # fmt: skip
        elif nproc is None:
            process = warm.start(command, REPO, env, stdout.fileno(), stderr.fileno())
        else:
            process = warm.torchrun(nproc, command, workdir / "runners", REPO, env, stdout.fileno(), stderr.fileno())
    return process, event_dir, checkpoint_dir


def run_trainer(
    workdir: Path,
    args: list[str],
    nproc: int | None = 2,
    signal_when: Callable[[list[dict]], bool] | None = None,
    signum: signal.Signals = signal.SIGKILL,
    checkpoint_dir: Path | None = None,
    attempt: int = 0,
    timeout: float = 300,
    module: str = "trainer.train",
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> TrainerRun:
    """Run to completion; with signal_when, send signum to every rank (pids from their
    init_start events) as soon as signal_when(rank 0's events so far) is true."""
    process, event_dir, checkpoint_dir = launch(workdir, args, nproc, checkpoint_dir, attempt, module, env, fresh)
    deadline = time.monotonic() + timeout
    try:
        while signal_when is not None and process.poll() is None:
            if signal_when(read_events(event_dir / rank_spool(0))):
                for spool in event_dir.glob(RANK_SPOOL_GLOB):
                    pid = next(e["data"]["pid"] for e in read_events(spool) if e["kind"] == "init_start")
                    os.kill(pid, signum)
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer {args}: condition not met in {timeout} s")
            time.sleep(0.01)
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            kill_tree(process.pid)
            process.wait()
    return TrainerRun(process.returncode, (workdir / STDERR_LOG).read_text(errors="replace"), event_dir, checkpoint_dir)


def kill_tree(pid: int) -> None:
    """SIGKILL pid and its descendants (torchrun starts each rank in a session of its own)."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*"):
            try:
                pids += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                pass
        i += 1
    for victim in pids:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def has_event(events: list[dict], kind: str, step: int | None = None) -> bool:
    return any(e["kind"] == kind and (step is None or e["step"] == step) for e in events)
