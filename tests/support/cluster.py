"""A whole ETT on this machine for end-to-end tests: a live service, agent daemons as real
processes (each a "node"), real torchrun ranks under them."""

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from agent.confinement.cgroups import agent_cgroup_name
from ett.protocol import JobEnv
from ett_cli.spec_file import load_spec
from service.migrate import upgrade
from service.settings import Settings
from tests.support.job_user import SUITE_USER_JOBS
from tests.support.live import LiveService, live_service
from tests.support.processes import pids_in_cgroups_of, pids_with_env
from tests.support.waiting import wait_for

TERMINAL = ("succeeded", "failed", "cancelled")
REPO = Path(__file__).resolve().parents[2]
EXAMPLE_JOBS = REPO / "examples" / "jobs"


@dataclass
class Cluster:
    service: LiveService
    root: Path
    user: httpx.Client
    admin: httpx.Client
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start_agents(self, *names: str, slots: int = 1) -> None:
        """Several agents started at once, then waited for: their start-ups overlap."""
        for name in names:
            self.start_agent(name, slots=slots, wait=False)
        for name in names:
            self.wait_registered(name)

    def start_agent(self, name: str, slots: int = 2, job_python: Path | None = None, cwd: Path = REPO,
                    wait: bool = True, **settings: str) -> subprocess.Popen:
        """An agent process (`ett agent`, started in `cwd`); with `job_python`, one that runs jobs as
        its default job user with that interpreter (tests/support/job_user.py), else as the suite's own user.
        `wait`: until it has registered."""
        env = {
            **os.environ, **({"ETT_AGENT_JOB_PYTHON": str(job_python)} if job_python else SUITE_USER_JOBS),
            "ETT_AGENT_SERVICE_URL": self.service.url, "ETT_AGENT_TOKEN_FILE": str(self._token_file(name)),
            "ETT_AGENT_NAME": name, "ETT_AGENT_SLOTS": str(slots), "ETT_AGENT_DATA_DIR": str(self.root / name),
            "ETT_AGENT_HEARTBEAT_INTERVAL_SECONDS": "1", "ETT_AGENT_HEARTBEAT_WAIT_SECONDS": "1",
            "ETT_AGENT_STOP_GRACE_SECONDS": "3",
            # Most of these tests' jobs are scripts: an agent warms what a job's first launch asks for, not the
            # trainer's server at its start (3.7 s of CPU each, unused by a script; `warm_at_start="trainer"`).
            "ETT_AGENT_WARM_AT_START": "none",
            **{f"ETT_AGENT_{k.upper()}": v for k, v in settings.items()},
        }  # fmt: skip
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 (kept open for the process's life)
        proc = subprocess.Popen([str(Path(sys.executable).parent / "ett"), "agent"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
        self.agents[name] = proc
        if wait:
            self.wait_registered(name)
        return proc

    def lose_node(self, name: str, job_id: str) -> set[int]:
        """The node goes as a machine does, all at once: its agent, the job's ranks on it (SIGKILL)
        and its node-local checkpoint folder; returns the pids killed."""
        return self.lose_nodes([name], job_id)

    def lose_nodes(self, names: list[str], job_id: str) -> set[int]:
        """Several nodes go at the same moment (lose_node): every process of theirs is found before
        any is killed. Killed one node after the other, the second's agent lived through the first's
        loss on a loaded machine, heartbeating after its peers' failure: it was not lost with the first."""
        local = [self.root / name / "checkpoints" / job_id for name in names]
        pids = {pid for name, folder in zip(names, local, strict=True)
                for pid in (*pids_with_env(JobEnv.CHECKPOINT_LOCAL_DIR, str(folder)),
                            *pids_in_cgroups_of(agent_cgroup_name(name, self.root / name)), self.agents[name].pid)}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile is gone all the same
                os.kill(pid, signal.SIGKILL)
        for folder in local:
            shutil.rmtree(folder, ignore_errors=True)
        return pids

    def wait_registered(self, name: str) -> None:
        wait_for(lambda: self._registered(name), 60, f"agent {name} to register")

    def _token_file(self, name: str) -> Path:
        """The agent's token in a file only its owner reads, as an operator would keep it."""
        path = self.root / f"{name}.token"
        path.write_text(self.service.token("agent", name))
        path.chmod(0o600)
        return path

    def _registered(self, name: str) -> bool:
        from service.models import Node

        with self.service.context.sessions() as session:
            return session.query(Node).filter_by(name=name).count() == 1

    def submit(self, **spec: Any) -> str:
        response = self.user.post("/api/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def job(self, job_id: str) -> dict[str, Any]:
        return self.user.get(f"/api/v1/jobs/{job_id}").raise_for_status().json()

    def report(self, job_id: str) -> dict[str, Any]:
        return self.user.get(f"/api/v1/jobs/{job_id}/ett").raise_for_status().json()

    def wait_job(self, job_id: str, states: tuple[str, ...] = TERMINAL, timeout: float = 240) -> dict[str, Any]:
        return wait_for(lambda: (j := self.job(job_id))["state"] in states and j, timeout,
                        f"job {job_id} to be {'/'.join(states)}", interval=0.5)

    def attempts(self, job: dict[str, Any], count: int) -> list[dict[str, Any]]:
        """The job's attempts, asserted to be `count`; where they are not, the message says each
        attempt's cause, detail and diagnosis, and the logs' tails: a restart nobody asked for."""
        attempts = job["attempts"]
        told = [(a["cause"], a["detail"], a["diagnosis"], a["summary"]) for a in attempts]
        assert len(attempts) == count, f"attempts (cause, detail, diagnosis, summary): {told}\n{self.logs()}"
        return attempts

    def agent_failures(self) -> list[str]:
        """Lines of the agents' logs where a poll of a worker group failed (a bug, not a job's fault)."""
        return [line for name in self.agents for line in (self.root / f"{name}.log").read_text(errors="replace")
                .splitlines() if "poll failed" in line or "forwarding failed" in line]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.root.glob("*.log"))


def events(c: Cluster, job_id: str, kind: str) -> list:
    from service.models import JobEvent

    with c.service.context.sessions() as session:
        query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == kind).order_by(JobEvent.ts)
        return list(session.scalars(query))


def newest_committed_before_the_failure(c: Cluster, job_id: str) -> int:
    """The step of the newest checkpoint attempt 0 committed before it failed: where attempt 1 resumes
    at the earliest."""
    from service.models import Checkpoint

    failed_at = events(c, job_id, "attempt_failed")[0].ts
    with c.service.context.sessions() as session:
        committed = session.scalars(select(Checkpoint).where(
            Checkpoint.job_id == job_id, Checkpoint.attempt == 0, Checkpoint.committed_at <= failed_at)).all()
    return max((ckpt.step for ckpt in committed), default=0)


def named_checkpoint_step(c: Cluster, job_id: str, attempt: int = 1) -> int:
    """The step of the checkpoint the service named for `attempt` (its `resume_from`: the newest committed
    when the attempt was scheduled; 0: none), asserted to be no older than the newest committed before the
    failure. It may be newer: the survivors' save whose commit came in as the attempt failed (seen on a
    loaded machine)."""
    named = c.job(job_id)["attempts"][attempt]["resume_from"]
    step = int(re.findall(r"\d+", Path(named).name)[-1]) if named else 0
    assert step >= newest_committed_before_the_failure(c, job_id), named
    return step


def assert_categories_sum_to_wall(report: dict) -> None:
    assert math.isclose(sum(report["seconds"].values()), report["wall_seconds"], abs_tol=1e-6)
    assert all(v >= 0 for v in report["seconds"].values())


def example_job(file_name: str, **overrides: Any) -> dict[str, Any]:
    """A job file of examples/jobs, read as `ett submit` reads it, with top-level fields replaced."""
    return load_spec(EXAMPLE_JOBS / file_name) | overrides


def trainer_job(name: str = "e2e", **overrides: Any) -> dict[str, Any]:
    """A small real MoE job (examples/jobs/moe_trainer.toml): 2 nodes x 2 ranks, EP 2, ZeRO-3,
    24 steps, checkpoints every 5 steps."""
    return example_job("moe_trainer.toml", name=name, **overrides)


@contextmanager
def cluster(tmp_path: Path, **settings: Any) -> Iterator[Cluster]:
    """The service on SQLite (short deadlines for tests); agents are added with start_agent. The scheduler
    ticks at the service's own period: woken by each submit and report, it needs no faster one, and at a
    quarter second its ticks took 12% of a core in each test's process (BENCHMARKS.md, 2026-11-29)."""
    config = Settings(
        database_url=f"sqlite:///{tmp_path / 'ett.db'}", data_dir=tmp_path / "service",
        checkpoint_root=tmp_path / "checkpoints", restart_backoff_seconds=0.5, **settings,
    )  # fmt: skip
    upgrade(config.resolved_database_url)
    with live_service(config) as live:
        with live.client(live.token("user", "alice")) as user, live.client(live.token("admin")) as admin:
            c = Cluster(service=live, root=tmp_path, user=user, admin=admin)
            try:
                yield c
            finally:
                for proc in c.agents.values():
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGTERM)
                for proc in c.agents.values():
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
