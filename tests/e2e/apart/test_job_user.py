"""An agent started as root never runs a job as root: its ranks, torchrun and its warm server run
as the owner's own uid (the first job uid plus the owner's number), with an interpreter that user
can run, and still checkpoint and resume. Real agents, real torchrun ranks, real uids."""

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from agent.settings import AgentSettings
from service.models import Owner
from ett.protocol import LOG_FILE
from tests.e2e.test_own_scripts import run_with_a_kill
from tests.support.cluster import REPO, Cluster, cluster, example_job, trainer_job
from tests.support.job_user import job_python, open_folder

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="needs agents started as root")]


def owner_uid(c: Cluster, owner: str) -> int:
    """The uid the agents run the owner's jobs as (agent/confinement/job_user.py: their default first job uid)."""
    with c.service.context.sessions() as session:
        return AgentSettings.model_fields["job_uid_base"].default + session.scalars(
            select(Owner.id).where(Owner.name == owner)).one()


@pytest.fixture(scope="module")
def open_root() -> Iterator[Path]:
    """A folder any user may enter (pytest's own are closed to others): agents' data, checkpoints,
    the job interpreter."""
    with open_folder("ett-job-user-") as root:
        yield root


@pytest.fixture(scope="module")
def python(open_root: Path) -> Path:
    return job_python(open_root / "job-python")


def owners(folder: Path) -> set[int]:
    return {path.stat().st_uid for path in folder.rglob("*")}


def uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def warm_servers(root: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent.warm.server" in argv and any(arg.startswith(os.fsencode(root)) for arg in argv):
            pids.append(int(proc.name))
    return pids


@pytest.mark.over_budget("a job as its owner's uid, killed and resumed, then a closed interpreter refused")
def test_an_entrypoint_job_runs_as_its_owner_and_resumes_and_a_closed_program_is_named(open_root, python, tmp_path):
    root = open_root / "entrypoint"
    root.mkdir()
    with cluster(root) as c:
        job = run_with_a_kill(c, example_job("plain_ddp.toml"), job_python=python)
        alice = owner_uid(c, "alice")
        assert owners(root / "checkpoints" / "alice" / job["id"]) == {alice}  # the ranks wrote (and pruned) as alice's
        assert stat.S_IMODE((root / "checkpoints" / "alice" / job["id"]).stat().st_mode) == 0o700

        # A program the job's user cannot run: the attempt says so in one line, naming it.
        closed = tmp_path / "train.sh"  # pytest's folders are closed to other users
        closed.write_text("#!/bin/sh\nexit 0\n")
        closed.chmod(0o755)
        failed = c.wait_job(c.submit(name="closed", nodes=1, procs_per_node=1, entrypoint=[str(closed)],
                                     max_restarts=0))
        assert failed["state"] == "failed"
        assert "Permission denied" in failed["attempts"][0]["detail"] and str(closed) in failed["attempts"][0]["detail"]

        # A script that is not there: checked as the job's user before the rank starts, the job
        # ends at once, not retried, naming the file (it was tried 3 times, its reason in torchrun.log).
        typo = c.wait_job(c.submit(name="typo", nodes=1, procs_per_node=1, max_restarts=2,
                                   entrypoint=["python", "examples/plain_dpp.py"]))
        assert typo["state"] == "failed" and len(typo["attempts"]) == 1
        assert typo["reason"].endswith(f"rank 0 cannot start: examples/plain_dpp.py (in {REPO}): No such file or directory")


def test_a_trainer_job_forks_warm_as_its_owner_and_resumes(open_root, python):
    root = open_root / "trainer"
    root.mkdir()
    with cluster(root) as c:
        job = run_with_a_kill(c, trainer_job("as-alice"), job_python=python)
        servers = warm_servers(root)
        alice = owner_uid(c, "alice")
        assert servers and {uid_of(pid) for pid in servers} == {alice}
        assert not c.agent_failures()
    assert owners(root / "checkpoints" / "alice" / job["id"]) == {alice}
    # The restart's ranks and torchrun were forked by the server (the first attempt may come before
    # its imports are done, and then starts fresh interpreters).
    logs = [log.read_text() for log in root.glob(f"node-*/*/{job['id']}/1/{LOG_FILE}")]
    assert len(logs) == 2 and not any("no warm start" in log for log in logs)
