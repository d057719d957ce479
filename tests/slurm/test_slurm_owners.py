"""Two owners' jobs on a real Slurm cluster (tests/support/slurm.py) are apart, as on nodes run by
hand: each runs as a uid of its owner's, under agents Slurm starts as root; neither job reads an
allocation's agent token (its own included) nor lists an agent's data folder or reads the files
there; the token is in a file of mode 600 and in no command line, environment or Slurm record
(docs/slurm.md, "Who runs what"; docs/reliability.md, "Security properties")."""

import json
import os
import re
import stat
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from agent.settings import AgentSettings
from service.models import Owner
from tests.proofs.cluster import Cluster
from tests.support.slurm import SlurmCluster
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# A rank that says who it is, waits for the paths it is to try, tries each and writes what came of it.
PROBE = """
import json, os, time
ckpt = os.environ["ETT_CHECKPOINT_DIR"]
with open(os.path.join(ckpt, "ready.tmp"), "w") as f:
    json.dump({"pid": os.getpid(), "env": dict(os.environ)}, f)
os.rename(os.path.join(ckpt, "ready.tmp"), os.path.join(ckpt, "ready.json"))
while not os.path.exists(os.path.join(ckpt, "targets.json")):
    time.sleep(0.2)
def attempt(op, path):
    try:
        if op == "list":
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(16)
        return "done"
    except OSError as exc:
        return exc.strerror
with open(os.path.join(ckpt, "targets.json")) as f:
    targets = json.load(f)
tried = {f"{op} {path}": attempt(op, path) for op, paths in targets.items() for path in paths}
with open(os.path.join(ckpt, "tried.json"), "w") as f:
    json.dump(tried, f)
"""


def submit_as(ett: Cluster, owner: str, spec: dict) -> str:
    token = ett.token("user", owner)
    with httpx.Client(base_url=ett.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        response = client.post("/api/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def owner_uid(ett: Cluster, owner: str) -> int:
    """The uid the agents run the owner's jobs as: the first job uid plus the owner's number."""
    with ett.sessions() as session:
        number = session.scalars(select(Owner.id).where(Owner.name == owner)).one()
    return AgentSettings.model_fields["job_uid_base"].default + number


def uids_of(pid: int) -> set[int]:
    """Real, effective, saved and file-system uids."""
    status = Path(f"/proc/{pid}/status").read_text()
    return set(map(int, next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]))


def argvs() -> dict[int, list[str]]:
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            found[int(proc.name)] = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    return found


def agent_data_dir(slurm_id: str) -> Path:
    """The --data-dir of the allocation's agent (one node each here)."""
    for argv in argvs().values():
        if "--name" in argv[:-1] and argv[argv.index("--name") + 1].startswith(f"slurm-{slurm_id}-"):
            return Path(argv[argv.index("--data-dir") + 1])
    raise AssertionError(f"no agent of Slurm job {slurm_id}")


def test_two_owners_jobs_run_as_their_own_uids_and_neither_reads_a_token_or_an_agents_data(ett: Cluster,
                                                                                           slurm: SlurmCluster, python,
                                                                                           open_root):  # fmt: skip
    script = open_root / "probe.py"
    script.write_text(PROBE)
    spec = {"nodes": 1, "procs_per_node": 1, "max_restarts": 0, "hang_timeout_seconds": None,
            "entrypoint": [str(python), str(script)], "slurm": {"partition": "batch", "time_limit": "10"}}  # fmt: skip
    owners = ("alice", "bob")
    jobs = {owner: submit_as(ett, owner, spec | {"name": f"probe-{owner}"}) for owner in owners}
    folders = {owner: ett.checkpoint_area(owner) / job_id for owner, job_id in jobs.items()}
    wait_for(lambda: all((folders[o] / "ready.json").exists() for o in owners), 180, "both probes to run",
             explain=lambda: str({o: ett.job(j)["state"] for o, j in jobs.items()}))
    ready = {owner: json.loads((folders[owner] / "ready.json").read_text()) for owner in owners}

    # Each rank runs as its owner's uid, the two uids apart, root neither.
    uids = {owner: owner_uid(ett, owner) for owner in owners}
    assert uids["alice"] != uids["bob"] and 0 not in uids.values()
    for owner in owners:
        assert uids_of(ready[owner]["pid"]) == {uids[owner]}, owner

    slurm_ids = {owner: ett.job(job_id)["slurm"]["job_id"] for owner, job_id in jobs.items()}
    tokens = {owner: ett.root / "service" / "slurm" / job_id / "0" / "agent.token" for owner, job_id in jobs.items()}
    data = {owner: agent_data_dir(slurm_ids[owner]) for owner in owners}
    for owner in owners:
        # The token: the agent's user's (root's) alone, in a folder of its own.
        token = tokens[owner].stat()
        assert (token.st_uid, stat.S_IMODE(token.st_mode)) == (os.getuid(), 0o600), owner
        # Its folder, the job's above it and ETT_SLURM_DIR: 0700, no one else lists the jobs.
        assert {stat.S_IMODE(tokens[owner].parents[up].stat().st_mode) for up in range(3)} == {0o700}, owner
        # The data folder: made by mktemp (a name no one could lay first), root's, listed by no one else.
        assert re.fullmatch(rf"ett-slurm-{slurm_ids[owner]}-n[12]\.[A-Za-z0-9]{{10}}", data[owner].name), data[owner]
        folder = data[owner].stat()
        assert (folder.st_uid, stat.S_IMODE(folder.st_mode)) == (0, 0o711), owner

    # The secret is nowhere but in its file: no rank's environment (read while the ranks wait), no
    # process's command line, none of what Slurm keeps of the job (its record, its batch script).
    secrets = {owner: tokens[owner].read_text().strip() for owner in owners}
    for owner in owners:
        environ = Path(f"/proc/{ready[owner]['pid']}/environ").read_bytes().decode(errors="replace")
        seen = [environ, json.dumps(ready[owner]["env"]), *("\0".join(argv) for argv in argvs().values()),
                slurm.run("scontrol", "-dd", "show", "job", slurm_ids[owner]),
                slurm.run("scontrol", "write", "batch_script", slurm_ids[owner], "-")]  # fmt: skip
        assert not [text for text in seen for secret in secrets.values() if secret in text], owner
        assert not [name for name in ready[owner]["env"] if name.startswith("ETT_AGENT_")], owner

    # Each job tries the other's token and its own, and lists both agents' data folders and
    # reads or lists everything at their top.
    for owner, other in (("alice", "bob"), ("bob", "alice")):
        inside = sorted(data[other].iterdir())
        targets = {"read": [str(tokens[other]), str(tokens[owner]), *(str(p) for p in inside if p.is_file())],
                   "list": [str(data[other]), str(data[owner]), str(tokens[other].parent), str(tokens[owner].parent),
                            *(str(p) for p in inside if p.is_dir())]}  # fmt: skip
        assert inside, f"{data[other]} is empty"
        staged = folders[owner] / "targets.tmp"
        staged.write_text(json.dumps(targets))
        staged.rename(folders[owner] / "targets.json")

    for owner, job_id in jobs.items():
        job = ett.wait_job(job_id, 120)
        assert job["state"] == "succeeded", (job, ett.logs())
        tried = json.loads((folders[owner] / "tried.json").read_text())
        assert len(tried) >= 7 and set(tried.values()) == {"Permission denied"}, (owner, tried)
