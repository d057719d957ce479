"""Two owners' jobs on one machine, under agents started as root, are apart: bob's job, an
intruder, tries to read, write, append to and create in everything of alice's running job it can
name (her checkpoints, her attempt's events, records and control folder, the agent's own files
beside them, her home folder) and succeeds at none of it; what it does in its own folder works.
Real agents, real torchrun ranks, real uids (docs/reliability.md, "Security")."""

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.files.spool import AttemptPaths
from ett.protocol import rank_log, rank_spool
from tests.e2e.apart.test_job_user import owner_uid
from tests.support.cluster import cluster
from tests.support.job_user import job_python, open_folder
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="needs agents started as root")]

VICTIM = """
import json, os, time
ckpt, events = os.environ["ETT_CHECKPOINT_DIR"], os.environ["ETT_EVENT_DIR"]
os.makedirs(os.path.join(ckpt, "step-00000001"), exist_ok=True)
with open(os.path.join(ckpt, "step-00000001", "model.bin"), "wb") as f:
    f.write(b"alice's weights")
with open(os.path.join(events, "rank-0.jsonl"), "a") as f:
    f.write(json.dumps({"kind": "init_start", "ts": time.time(), "attempt": 0, "source": "rank:0", "seq": 0,
                        "step": None, "data": {}}) + "\\n")
open(os.path.join(ckpt, "ready"), "w").close()
while not os.path.exists(os.path.join(ckpt, "done")):
    time.sleep(0.2)
"""

# Every way in, for each path: what a job would try. Writes append a harmless byte or create a file.
INTRUDER = """
import json, os, sys
targets, out = json.loads(sys.argv[1]), os.path.join(os.environ["ETT_CHECKPOINT_DIR"], "tried.json")
def attempt(op, path):
    try:
        if op == "list":
            os.listdir(path)
        elif op == "read":
            with open(path, "rb") as f:
                f.read(16)
        elif op == "append":
            with open(path, "ab") as f:
                f.write(b"\\n")
        elif op == "create":
            with open(os.path.join(path, "intruder"), "wb") as f:
                f.write(b"x")
        return "done"
    except OSError as exc:
        return exc.strerror
tried = {f"{op} {path}": attempt(op, path) for op, paths in targets.items() for path in paths}
with open(out, "w") as f:
    json.dump(tried, f)
"""


@pytest.fixture(scope="module")
def open_root() -> Iterator[Path]:
    with open_folder("ett-apart-") as root:
        yield root


def test_two_owners_jobs_cannot_touch_each_other(open_root):
    python = job_python(open_root / "job-python")
    scripts = open_root / "scripts"
    scripts.mkdir()
    (scripts / "victim.py").write_text(VICTIM)
    (scripts / "intruder.py").write_text(INTRUDER)
    with cluster(open_root) as c:
        c.start_agent("node-a", slots=1, job_python=python)
        c.start_agent("node-b", slots=1, job_python=python)
        victim = c.submit(name="victim", nodes=1, procs_per_node=1, entrypoint=[str(python), str(scripts / "victim.py")],
                          hang_timeout_seconds=None, max_restarts=0)
        alice_ckpt = open_root / "checkpoints" / "alice" / victim
        wait_for(lambda: (alice_ckpt / "ready").exists(), 120, "alice's job to be under way")
        node = c.job(victim)["attempts"][0]["nodes"][0]
        paths = AttemptPaths.of(open_root / node / "spool", victim, 0)
        attempt = paths.root
        home = open_root / node / "homes" / str(owner_uid(c, "alice"))
        files = [alice_ckpt / "step-00000001" / "model.bin", paths.events_dir / rank_spool(0), paths.ranks_file,
                 paths.log_file, paths.launch_file, paths.node_spool(node), paths.logs_dir / rank_log(0),
                 open_root / node / "forward-offsets.json"]
        folders = [alice_ckpt, alice_ckpt / "step-00000001", paths.events_dir, paths.control_dir, paths.logs_dir,
                   attempt, home,
                   attempt.parent, open_root / node / "spool", open_root / node]
        # The agent's own files come as it goes (its read positions once it has forwarded a batch).
        wait_for(lambda: all(path.exists() for path in files + folders), 30, "every file and folder to be there",
                 explain=lambda: str([p for p in files + folders if not p.exists()]))
        targets = {"read": files, "append": files, "list": folders, "create": folders}

        bob = c.service.client(c.service.token("user", "bob"))
        spec = {"name": "intruder", "nodes": 1, "procs_per_node": 1, "max_restarts": 0,
                "entrypoint": [str(python), str(scripts / "intruder.py"),
                               json.dumps({op: [str(p) for p in paths] for op, paths in targets.items()})]}
        response = bob.post("/api/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        intruder = response.json()["id"]
        job = wait_for(lambda: (j := bob.get(f"/api/v1/jobs/{intruder}").json())["state"] in ("succeeded", "failed")
                       and j, 120, "the intruder's job to end")
        assert job["state"] == "succeeded", c.logs()
        bob_ckpt = open_root / "checkpoints" / "bob" / intruder
        tried = json.loads((bob_ckpt / "tried.json").read_text())

        assert len(tried) == 2 * (len(files) + len(folders))
        assert {how for how in tried.values()} == {"Permission denied"}, {k: v for k, v in tried.items()
                                                                          if v != "Permission denied"}
        assert owner_uid(c, "bob") != owner_uid(c, "alice")
        assert {p.stat().st_uid for p in bob_ckpt.rglob("*")} == {owner_uid(c, "bob")}  # its own folder: written
        assert (alice_ckpt / "step-00000001" / "model.bin").read_bytes() == b"alice's weights"
        assert c.job(victim)["state"] == "running"  # untouched by all of it
        (alice_ckpt / "done").touch()
        assert c.wait_job(victim)["state"] == "succeeded", c.logs()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
