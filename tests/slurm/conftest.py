"""What the Slurm tests share, one of each per test module: a real Slurm cluster (tests/support/slurm.py)
and an ETT service submitting to it. The service runs as root, so its allocations' agents do, and
each owner's jobs run as a uid of that owner's (docs/slurm.md, "Who runs what"): with an
interpreter those uids can run, and the service's folders (checkpoints among them) in a folder
they may enter."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proofs.cluster import AGENT_ENV, Cluster, cluster, fake_rank_job
from tests.support.job_user import job_python, open_folder
from tests.support.slurm import KILL_WAIT_SECONDS, SlurmCluster, slurm_cluster

# The agents Slurm starts: fast heartbeats, and a stop grace inside Slurm's KillWait, so a rank's
# final checkpoint is not cut short by the agent before Slurm's SIGKILL would.
SLURM_AGENT_ENV = AGENT_ENV | {"ETT_AGENT_STOP_GRACE_SECONDS": str(KILL_WAIT_SECONDS - 5)}


def service_env(slurm: SlurmCluster, python: Path) -> dict[str, str]:
    """The service's Slurm settings: its agents run the jobs' processes with `python`."""
    agent_env = SLURM_AGENT_ENV | {"ETT_AGENT_JOB_PYTHON": str(python)}
    return {"ETT_SLURM": "true", "ETT_SLURM_POLL_SECONDS": "0.5", "ETT_SLURM_AGENT_ENV": json.dumps(agent_env),
            "ETT_SLURM_AGENT_START_SECONDS": "60"} | slurm.env  # fmt: skip


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[SlurmCluster]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


@pytest.fixture(scope="module")
def open_root() -> Iterator[Path]:
    with open_folder("ett-slurm-tests-") as root:
        yield root


@pytest.fixture(scope="module")
def python(open_root) -> Path:
    return job_python(open_root / "job-python")


@pytest.fixture(scope="module")
def ett(slurm, open_root, python) -> Iterator[Cluster]:
    root = open_root / "ett"
    root.mkdir()
    with cluster(root, **service_env(slurm, python)) as running:
        yield running


def slurm_job(python: Path, name: str, **spec) -> dict:
    """A job of the fake rank (tests/agent/scripts/fake_rank.py) run by `python`, on Slurm."""
    job = fake_rank_job(name, **{"slurm": {"partition": "batch", "time_limit": "10"}} | spec)
    job["entrypoint"][0] = str(python)  # the suite's own is under root's home: no job's uid may run it
    return job
