"""Spares warm before they are needed (issue #49, item 4): while a 2-node job runs, the service
tells the idle third agent to start the job's warm server (its user, its warm imports), and it
does, long before any failure; the job's own nodes are not told. The real service, three real
agents, torchrun ranks (gloo)."""

import pytest

from agent.warm.servers import imports_key
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
