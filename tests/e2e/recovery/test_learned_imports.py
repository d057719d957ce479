"""A job's own script that names no `warm_imports` starts and restarts warm anyway (issue #49, item
4): its first attempt forks from its user's base server (torch, ETT's library) and says what it
imported; each agent starts a server of those imports at once, and a restart forks from the base
server while that one still imports, from it once it listens. The real service, two real agents,
torchrun ranks (gloo), ranks SIGKILLed."""

import json

import pytest
from sqlalchemy import select

from agent.warm.servers import SCRIPT_BASE_IMPORTS, imports_key
from service.models import Job
from tests.support.cluster import cluster
from tests.support.job_user import open_folder
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

# What each rank started with is told before its first import: a rank forked from a warm server
# holds what the server imported, a fresh interpreter none of it. Attempt 1 waits at step 3 for the
# test's word, given once the server of what attempt 0 imported listens on both nodes.
SCRIPT = """
import json, os, sys, time
STARTED_WITH = sorted(name for name in ("torch", "idna", "warmgate", "jobhelper") if name in sys.modules)
import idna        # an installed package, which neither torch nor ETT imports
import warmgate    # on the agents' PYTHONPATH: a warm server that imports it waits for the test's word
import jobhelper   # the job's own module, beside this script
import torch.distributed as dist
import ett

dist.init_process_group("gloo")
attempt, rank = int(os.environ["ETT_ATTEMPT"]), dist.get_rank()
with open(os.path.join(os.environ["ETT_CHECKPOINT_DIR"], f"start-{attempt}-{rank}.json"), "w") as f:
    json.dump(STARTED_WITH, f)
go = os.path.join(os.path.dirname(os.path.abspath(__file__)), "go")
with ett.init() as run:
    for step in range(1, 21):
        with run.step(step):
            deadline = time.monotonic() + 240
            while attempt == 1 and step == 3 and not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.05)
            dist.barrier()
dist.destroy_process_group()
"""
# Whoever imports it says so: a warm server that did would write its own argv[0] (agent/warm/server.py).
HELPER = """
import os, sys
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported-by"), "a") as f:
    f.write(os.path.basename(sys.argv[0]) + "\\n")
"""
# A warm server importing it stays busy importing until the gate is laid: a server of what the
# script imported that does not listen yet, for as long as the test needs.
GATE = """
import os, sys, time
if os.path.basename(sys.argv[0]) == "server.py":
    deadline = time.monotonic() + 240
    while not os.path.exists({gate!r}) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.mark.over_budget("two agents, three attempts: forked from the base server, then from the learned one")
def test_a_script_without_warm_imports_restarts_from_the_base_server_until_the_learned_one_listens(
        tmp_path, monkeypatch):
    folder, site = tmp_path / "job", tmp_path / "site"
    folder.mkdir()
    site.mkdir()
    (folder / "learner.py").write_text(SCRIPT)
    (folder / "jobhelper.py").write_text(HELPER)
    (site / "warmgate.py").write_text(GATE.format(gate=str(tmp_path / "gate")))
    monkeypatch.setenv("PYTHONPATH", str(site))  # the agents', so their warm servers' and ranks'
    # A short root: a warm server's socket path must fit sun_path (107 bytes), which pytest's own
    # folder for a test of this name, nested in a worker's, does not leave room for.
    with open_folder("ett-warm-") as root, cluster(root) as c:
        c.start_agents("node-a", "node-b")
        job_id = c.submit(name="learner", nodes=2, procs_per_node=1, max_restarts=2, hang_timeout_seconds=120,
                          entrypoint=["python", str(folder / "learner.py")],
                          faults=[{"attempt": 0, "rank": 1, "at_step": 2, "action": "kill"},
                                  {"attempt": 1, "rank": 1, "at_step": 6, "action": "kill"}])  # fmt: skip
        starts = c.root / "checkpoints"

        def started(attempt: int) -> dict[str, list[str]] | None:
            found = {p.name: json.loads(p.read_text()) for p in starts.rglob(f"start-{attempt}-*.json")}
            return found if len(found) == 2 else None

        restarted = wait_for(lambda: started(1), 240, "attempt 1's ranks to start", explain=c.logs)
        with c.service.context.sessions() as session:
            learned = session.scalar(select(Job.learned_imports).where(Job.id == job_id))
        own = [next(c.root.glob(f"{node}/warm/*/w-{imports_key(learned)}.sock"), None) for node in ("node-a", "node-b")]
        assert own == [None, None]  # the learned servers still import: the restart did not wait for them
        (tmp_path / "gate").touch()
        wait_for(lambda: all(any(c.root.glob(f"{node}/warm/*/w-{imports_key(learned)}.sock"))
                             for node in ("node-a", "node-b")), 240, "the learned servers to listen")
        (folder / "go").touch()
        job = c.wait_job(job_id, timeout=300)
        assert job["state"] == "succeeded" and len(job["attempts"]) == 3, c.logs()
        forked = [line for node in ("node-a", "node-b") for line in (c.root / f"{node}.log").read_text().splitlines()
                  if "forks from warm server" in line]  # fmt: skip
        first, last = started(0), started(2)
    assert "warmgate" in learned and any(name.startswith("idna.") for name in learned), learned  # leaves of their trees
    assert not any(name.partition(".")[0] in ("jobhelper", "learner") for name in learned)
    # Attempts 0 and 1 forked on both nodes from the base server (torch loaded, nothing of the
    # script's own), attempt 2 from the server of what attempt 0 imported.
    assert first == {"start-0-0.json": ["torch"], "start-0-1.json": ["torch"]}, first
    assert restarted == {"start-1-0.json": ["torch"], "start-1-1.json": ["torch"]}, restarted
    assert last == {"start-2-0.json": ["idna", "torch", "warmgate"],
                    "start-2-1.json": ["idna", "torch", "warmgate"]}, last  # fmt: skip
    base, own = f"w-{imports_key(SCRIPT_BASE_IMPORTS)}.sock", f"w-{imports_key(learned)}.sock"
    assert sorted(line.rsplit(" ", 1)[1] for line in forked) == sorted([base] * 4 + [own] * 2), forked
    # The job's own module: imported by its ranks alone, 2 a try, never by a warm server.
    assert (folder / "imported-by").read_text().split() == ["learner.py"] * 6
