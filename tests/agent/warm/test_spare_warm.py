"""A spare told to warm a job's server (WarmCommand) starts it as the user it would launch that job
as, and starts none it would refuse: real servers, run as the owner's own uid by an agent's parts
started as root (agent.groups.warm_choice)."""

import os
import random
from pathlib import Path

import pytest

from agent.confinement.job_user import JobUsers
from agent.groups.supervisor import Supervisor
from agent.warm.servers import WarmServers
from ett.protocol.messages import WarmCommand
from tests.support.job_user import job_python, open_folder
from tests.support.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a uid per owner needs root")


@pytest.fixture
def root():
    with open_folder("ett-spare-") as folder:
        job_python(folder / "python")
        yield folder


def warm_command(owner_number: int, entrypoint: list[str] | None = ["python", "train.py"]) -> WarmCommand:  # noqa: B006
    return WarmCommand(type="warm", job_id="j1", owner="alice", owner_number=owner_number, entrypoint=entrypoint,
                       warm_imports=["idna"])


def uids(pid: int) -> set[int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {int(n) for line in status if line.startswith("Uid:") for n in line.split()[1:]}


def test_a_spare_warms_a_jobs_server_as_its_owners_uid_and_never_as_one_it_would_refuse(root):
    base = 1_800_000_000 + random.randrange(100_000) * 1_000  # no other test's owners
    users = JobUsers(str(root / "python" / "bin" / "python"), None, base, 1_000, root / "homes")
    warm = WarmServers(root / "data", ["unused"], None)
    spare = Supervisor(root / "spool", "spare", 1.0, warm=warm, job_users=users)
    try:
        spare.prewarm(warm_command(owner_number=1_000))  # past the agent's range: a launch would be refused
        spare.prewarm(warm_command(owner_number=7, entrypoint=["bash", "train.sh"]))  # no script: starts fresh
        assert warm.pids() == set() and not (root / "data" / "warm").exists()
        spare.prewarm(warm_command(owner_number=7))
        [pid] = wait_for(warm.pids, 10, "the job's warm server to start")
        # Real, effective, saved and file-system uid: the owner's, as its launch; exec'd as root, it becomes
        # the owner first thing (agent.confinement.become).
        wait_for(lambda: uids(pid) == {base + 7}, 10, "the server to become the owner", explain=lambda: str(uids(pid)))
        assert (root / "data" / "warm" / str(base + 7)).stat().st_uid == base + 7
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[-3:] == [b"--imports", b"idna", b""]  # the server of the job's own imports
    finally:
        warm.stop()
