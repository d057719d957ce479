"""What the tests of hostile jobs share (tests/e2e/apart/test_hostile_jobs.py, tests/e2e/apart/test_leftovers.py):
one service and one agent started as root serve a module; each attack is a script of its folder
`scripts/`, run as an owner's one-rank job; after it the agent lives and another owner's job (its
`bystander.py`, which leaves `ran` in its checkpoint folder) succeeds."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.cluster import TERMINAL, Cluster, cluster
from tests.support.job_user import job_python, open_folder
from tests.support.waiting import wait_for

BYSTANDER = "import os; open(os.path.join(os.environ['ETT_CHECKPOINT_DIR'], 'ran'), 'w').close()\n"


@contextmanager
def hostile_node(prefix: str, scripts: dict[str, str], slots: int = 1) -> Iterator[tuple[Cluster, Path]]:
    """The service and one agent started as root (node-a, `slots`), the job interpreter (a copy every
    user may run), and `scripts` (name: text) with bystander.py in a folder every user may read."""
    with open_folder(prefix) as root:
        python = job_python(root / "job-python")
        folder = root / "scripts"
        folder.mkdir()
        for name, text in (scripts | {"bystander.py": BYSTANDER}).items():
            (folder / name).write_text(text)
        with cluster(root) as c:
            c.start_agent("node-a", slots=slots, job_python=python)
            yield c, python


def run(c: Cluster, owner: httpx.Client, python: Path, script: str, *args: str, **spec) -> str:
    """The job of one rank running `scripts/SCRIPT ARGS` with the module's interpreter, as `owner`."""
    response = owner.post("/api/v1/jobs", json={
        "name": script.removesuffix(".py"), "nodes": 1, "procs_per_node": 1, "max_restarts": 0,
        "hang_timeout_seconds": None, "entrypoint": [str(python), str(c.root / "scripts" / script), *args], **spec})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def checkpoint_dir(c: Cluster, owner: str, job_id: str) -> Path:
    return c.root / "checkpoints" / owner / job_id


def the_agent_lives_and_another_owners_job_succeeds(c: Cluster, python: Path) -> None:
    assert c.agents["node-a"].poll() is None, c.logs()
    bob = c.service.client(c.service.token("user", "bob"))
    job_id = run(c, bob, python, "bystander.py")
    job = wait_for(lambda: (j := bob.get(f"/api/v1/jobs/{job_id}").json())["state"] in TERMINAL and j, 120,
                   "bob's job to end")
    assert job["state"] == "succeeded", c.logs()
    assert (checkpoint_dir(c, "bob", job_id) / "ran").exists()
