"""Spares warm before they are needed (issue #49, item 4): while a 2-node job runs, the service
tells the idle third agent to start the job's warm server (its user, its warm imports), and it
does, long before any failure; the job's own nodes are not told. The real service, three real
agents, torchrun ranks (gloo)."""

import os

import pytest
from sqlalchemy import select

from agent.warm.servers import SCRIPT_BASE_IMPORTS, imports_key
from agent.warm.sockets import socket_folder
from service.models import Job
from tests.support.cluster import cluster
from tests.support.job_user import open_folder
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

# Holds the job at its third step until the test has seen what the spare did, then trains on.
SCRIPT = """
import os, time
import torch.distributed as dist
import ett

dist.init_process_group("gloo")
go = os.path.join(os.path.dirname(os.path.abspath(__file__)), "go")
with ett.init() as run:
    for step in range(1, 8):
        with run.step(step):
            deadline = time.monotonic() + 240
            while step == 3 and not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)
            dist.barrier()
dist.destroy_process_group()
"""
IMPORTS = ["idna", "torch.nn.parallel"]


@pytest.mark.over_budget("three agents, and a warm server started on the spare while the job runs")
def test_the_idle_spare_starts_the_running_jobs_warm_server_before_any_failure(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "held.py").write_text(SCRIPT)
    # A short root: a warm server's socket path must fit sun_path (107 bytes), which pytest's own
    # folder for a test of this name, nested in a worker's, does not leave room for.
    with open_folder("ett-warm-") as root, cluster(root) as c:
        c.start_agents("node-0", "node-1", "node-2")
        job_id = c.submit(name="held", nodes=2, procs_per_node=1, hang_timeout_seconds=120, warm_imports=IMPORTS,
                          entrypoint=["python", str(tmp_path / "job" / "held.py")])  # fmt: skip
        runs_on = wait_for(lambda: [a["nodes"] for a in c.job(job_id)["attempts"]], 120,
                           "the job's first attempt to be allocated")[0]
        [spare] = {"node-0", "node-1", "node-2"} - set(runs_on)
        sockets = c.root / spare / "warm"
        listening = wait_for(lambda: next(sockets.glob(f"*/w-{imports_key(IMPORTS)}.sock"), None), 240,
                             f"the spare {spare}'s warm server of the job's imports to listen", explain=c.logs)
        during = c.job(job_id)
        spare_log = (c.root / f"{spare}.log").read_text()
        (tmp_path / "job" / "go").touch()
        job = c.wait_job(job_id, timeout=240)
        told = {node: f"job {job_id}: warm server" in (c.root / f"{node}.log").read_text() for node in runs_on}
    assert during["state"] == "running" and len(during["attempts"]) == 1, during  # no failure came first
    assert during["attempts"][0]["state"] in ("allocated", "running")
    assert f"job {job_id}: warm server {listening.name} started here for its next attempt" in spare_log
    assert job["state"] == "succeeded" and len(job["attempts"]) == 1, job
    assert told == {node: False for node in runs_on}  # the job's own nodes run it: no warm command


# Holds before its ett.init, then at its third step, each until the test's word.
LEARNING = """
import os, time
import torch.distributed as dist
import idna  # an installed package, which neither torch nor ETT imports: learned, the spares warm it
import ett

def held(word):
    gate, deadline = os.path.join(os.path.dirname(os.path.abspath(__file__)), word), time.monotonic() + 240
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)

dist.init_process_group("gloo")
held("first")  # ett.init says what the script imported
with ett.init() as run:
    for step in range(1, 6):
        with run.step(step):
            if step == 3:
                held("go")
            dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.over_budget("three agents, the spare's two warm servers started while the first attempt runs")
def test_a_spare_idle_after_the_start_is_told_and_warms_what_the_first_attempt_learned(tmp_path):
    """What an attempt's start cannot tell a spare: node-2 registers once the attempt runs, and is told
    to warm the job's server (its base one: the job names no `warm_imports`); once the first attempt
    has said what its script imported (at its `ett.init`), the spare warms those too, while that
    attempt still runs, so a node loss in it restarts warm on the spare. In a deep folder: each agent
    binds its sockets in a short folder of its own (there, past 107 bytes), and forks its ranks warm."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "learner.py").write_text(LEARNING)
    deep = tmp_path / ("d" * 64)  # whatever pytest's folder: the agents' sockets would be past 107 bytes there
    deep.mkdir()
    with cluster(deep) as c:
        c.start_agents("node-0", "node-1")
        job_id = c.submit(name="learner", nodes=2, procs_per_node=1, hang_timeout_seconds=120,
                          entrypoint=["python", str(tmp_path / "job" / "learner.py")])  # fmt: skip
        wait_for(lambda: [a for a in c.job(job_id)["attempts"] if a["state"] == "running"], 120,
                 "the first attempt to run", explain=c.logs)
        c.start_agent("node-2", slots=1)
        sockets = socket_folder(c.root / "node-2")
        base = wait_for(lambda: next(sockets.glob(f"*/w-{imports_key(SCRIPT_BASE_IMPORTS)}.sock"), None), 120,
                        "the late spare's base server to listen", explain=c.logs)
        (tmp_path / "job" / "first").touch()
        learned = wait_for(lambda: learned_imports(c, job_id), 120, "the service to learn the script's imports",
                           explain=c.logs)
        own = wait_for(lambda: next(sockets.glob(f"*/w-{imports_key(learned)}.sock"), None), 120,
                       "the spare's server of the learned imports to listen", explain=c.logs)
        during = c.job(job_id)
        (tmp_path / "job" / "go").touch()
        job = c.wait_job(job_id, timeout=240)
        forked = [line for node in ("node-0", "node-1") for line in (c.root / f"{node}.log").read_text().splitlines()
                  if "forks from warm server" in line]  # fmt: skip
    assert len(os.fsencode(c.root / "node-2" / "warm" / "0" / own.name)) > 107 and not sockets.is_relative_to(c.root)
    assert base.parent == own.parent and any(name.partition(".")[0] == "idna" for name in learned), learned
    assert during["state"] == "running" and len(during["attempts"]) == 1, during  # all told in the first attempt
    assert job["state"] == "succeeded" and len(job["attempts"]) == 1, job
    assert len(forked) == 2, forked  # the job's own nodes forked its ranks too, from their short folders


def learned_imports(c, job_id: str) -> list[str] | None:
    with c.service.context.sessions() as session:
        return session.scalar(select(Job.learned_imports).where(Job.id == job_id))
