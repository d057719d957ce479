"""A real ETT cluster for the proofs: `ett service` and `ett agent` processes on loopback, SQLite
in a temporary folder, each process's output in its own log file, everything stopped at the end.

Unlike tests/support/cluster.py (the service in a thread of the test), the service here is a
process of its own, so a proof can SIGKILL it and start it again on the same database."""

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from service.db import make_engine, make_session_factory
from service.migrate import upgrade
from service.models import JobEvent, Node, Role
from service.security import create_token
from tests.support.job_user import SUITE_USER_JOBS
from tests.support.postgres import free_port
from tests.support.waiting import wait_for

FAKE_RANK = Path(__file__).parents[1] / "agent" / "scripts" / "fake_rank.py"
# Fast failure detection, so each proof takes seconds: agents heartbeat every second. They warm a job's server
# at its first launch, not the trainer's at their start (most of these jobs are scripts; tests/support/cluster.py).
SERVICE_ENV = {"ETT_HEARTBEAT_TIMEOUT_SECONDS": "5", "ETT_RESTART_BACKOFF_SECONDS": "0.5",
               "ETT_STOP_GRACE_SECONDS": "5", "ETT_SCHEDULER_PERIOD_SECONDS": "0.2"}  # fmt: skip
AGENT_ENV = {"ETT_AGENT_HEARTBEAT_INTERVAL_SECONDS": "1", "ETT_AGENT_HEARTBEAT_WAIT_SECONDS": "1",
             "ETT_AGENT_BATCH_MAX_AGE_SECONDS": "0.1", "ETT_AGENT_STOP_GRACE_SECONDS": "2",
             "ETT_AGENT_RETRY_MAX_SECONDS": "1", "ETT_AGENT_WARM_AT_START": "none"}  # fmt: skip


def fake_rank_job(name: str = "fake", nodes: int = 1, steps: int = 40, step_seconds: float = 0.1, **spec) -> dict:
    argv = [sys.executable, str(FAKE_RANK), "--steps", str(steps), "--step-seconds", str(step_seconds)]
    return {"name": name, "nodes": nodes, "procs_per_node": 2, "entrypoint": argv, "max_restarts": 2} | spec


@dataclass
class Cluster:
    root: Path
    service_env: dict[str, str]
    database_url: str = ""  # default: SQLite in root
    workers: int = 1  # `ett service --workers N` (PostgreSQL for more than one)
    port: int = field(default_factory=free_port)
    service: subprocess.Popen | None = None
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.database_url = self.database_url or f"sqlite:///{self.root / 'ett.db'}"
        upgrade(self.database_url)
        self.engine = make_engine(self.database_url)
        self.sessions = make_session_factory(self.engine)

    @property
    def checkpoint_root(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_area(self, owner: str = "alice") -> Path:
        """Where the owner's jobs may name their checkpoint folders."""
        return self.checkpoint_root / owner

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, argv: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        with open(self.root / log_name, "ab") as log:
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_service(self) -> None:
        env = os.environ | SERVICE_ENV | self.service_env | {
            "ETT_DATABASE_URL": self.database_url, "ETT_DATA_DIR": str(self.root / "service"),
            "ETT_PORT": str(self.port), "ETT_CHECKPOINT_ROOT": str(self.checkpoint_root)}  # fmt: skip
        argv = [sys.executable, "-m", "ett_cli.main", "service", "--workers", str(self.workers)]
        self.service = self._spawn(argv, env, "service.log")
        wait_for(self._ready, 60, "the service to answer /readyz", interval=0.2)

    def _ready(self) -> bool:
        if self.service.poll() is not None:
            raise AssertionError(f"the service exited with {self.service.returncode}; see {self.root / 'service.log'}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        return False

    def kill_service(self) -> None:
        os.killpg(self.service.pid, signal.SIGKILL)
        self.service.wait()

    def token(self, role: str, subject: str) -> str:
        if subject not in self.tokens:
            with self.sessions() as session:
                self.tokens[subject] = create_token(session, Role(role), subject)
                session.commit()
        return self.tokens[subject]

    def start_agent(self, name: str, slots: int = 2, **env: str) -> subprocess.Popen:
        agent_env = os.environ | AGENT_ENV | SUITE_USER_JOBS | env | {
            "ETT_AGENT_SERVICE_URL": self.url, "ETT_AGENT_TOKEN": self.token("agent", name), "ETT_AGENT_NAME": name,
            "ETT_AGENT_SLOTS": str(slots), "ETT_AGENT_DATA_DIR": str(self.root / name)}  # fmt: skip
        self.agents[name] = self._spawn([sys.executable, "-m", "agent.cli"], agent_env, f"{name}.log")
        wait_for(lambda: self.node(name) is not None, 60, f"agent {name} to register")
        return self.agents[name]

    def node(self, name: str) -> Node | None:
        with self.sessions() as session:
            return session.scalar(select(Node).where(Node.name == name))

    def client(self, role: str = "admin") -> httpx.Client:
        token = self.token(role, {"admin": "admin", "user": "alice"}[role])
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def submit(self, spec: dict) -> str:
        with self.client("user") as client:
            response = client.post("/api/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def job(self, job_id: str) -> dict:
        with self.client() as client:
            return client.get(f"/api/v1/jobs/{job_id}").raise_for_status().json()

    def report(self, job_id: str) -> dict:
        with self.client() as client:
            return client.get(f"/api/v1/jobs/{job_id}/ett").raise_for_status().json()

    def wait_job(self, job_id: str, timeout: float = 120) -> dict:
        ended = lambda: (j := self.job(job_id))["state"] in ("succeeded", "failed", "cancelled") and j  # noqa: E731
        return wait_for(ended, timeout, f"job {job_id} to end", interval=0.3)

    def events(self, job_id: str, **where: Any) -> list[JobEvent]:
        with self.sessions() as session:
            query = select(JobEvent).where(JobEvent.job_id == job_id).filter_by(**where)
            return list(session.scalars(query.order_by(JobEvent.ts)))

    def logs(self) -> dict[Path, str]:
        """Every log the run wrote: the processes' outputs and the attempts' torchrun logs."""
        paths = [*self.root.glob("*.log"), *self.root.glob("*/**/*.log")]
        return {p: p.read_text(errors="replace") for p in paths if p.is_file()}

    def close(self) -> None:
        # Agents first (they stop their ranks), the service last; SIGKILL whatever is left.
        processes = [*self.agents.values(), *([self.service] if self.service else [])]
        for proc in processes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in processes:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.engine.dispose()


@contextlib.contextmanager
def cluster(root: Path, database_url: str = "", workers: int = 1, **service_env: str) -> Iterator[Cluster]:
    """A migrated database and a running service; agents are started by the test."""
    c = Cluster(root, {k: str(v) for k, v in service_env.items()}, database_url, workers)
    try:
        c.start_service()
        yield c
    finally:
        c.close()
