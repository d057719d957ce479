"""What a job writes is hostile input (#48): each test is an attack a job makes on the root agent
that serves every owner of its node, with real processes (an agent started as root, torchrun, the
owner's own uid). After each the agent lives, and another owner's job on the same node succeeds.
One service and one agent serve the whole module, as one node serves its owners' jobs in turn."""

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from ett.protocol import CONTROL_DIR, LOGS_DIR, RANKS_FILE, rank_log
from service.models import RankLog
from tests.support.cluster import TERMINAL, Cluster, cluster
from tests.support.job_user import job_python, open_folder
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="needs an agent started as root")]

# Each attack's script: does its harm, says so in its checkpoint folder ("done"), then waits for
# the test's word ("end") or to be cancelled.
WAIT_FOR_END = """
open(os.path.join(os.environ["ETT_CHECKPOINT_DIR"], "done"), "w").close()
while not os.path.exists(os.path.join(os.environ["ETT_CHECKPOINT_DIR"], "end")):
    time.sleep(0.1)
"""
NESTED_LINE = f"""
import os, sys, time
control = os.path.join(os.path.dirname(os.environ["ETT_EVENT_DIR"]), {CONTROL_DIR!r}, {RANKS_FILE!r})
with open(control, "a") as f:  # deeper than any parser recurses
    f.write("[" * 200_000 + "]" * 200_000 + "\\n")
""" + WAIT_FOR_END
SOCKET_FOLDER = """
import os, signal, time
for pid in filter(str.isdigit, os.listdir("/proc")):  # the warm server that forked this rank, as its socket names it
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\\0")
    except OSError:
        continue
    if "agent.warm.server" in argv and os.stat(f"/proc/{pid}").st_uid == os.getuid():
        socket = argv[argv.index("agent.warm.server") + 1]
        os.unlink(socket)
        os.mkdir(socket)  # where the agent will look for its socket, and would remove it
        open(os.path.join(os.environ["ETT_CHECKPOINT_DIR"], "done"), "w").close()
        os.kill(int(pid), signal.SIGKILL)  # and this rank with it (its parent-death signal)
"""
SPARSE_FILES = """
import os, sys, time
for i in range(int(sys.argv[1])):  # a terabyte each, of no disk: zeros and no newline
    with open(os.path.join(os.environ["ETT_EVENT_DIR"], f"rank-{i + 1}.jsonl"), "wb") as f:
        f.truncate(1 << 40)
""" + WAIT_FOR_END
FAR_RANK_LOG = f"""
import os, sys, time
logs = os.path.join(os.path.dirname(os.environ["ETT_EVENT_DIR"]), {LOGS_DIR!r})
with open(os.path.join(logs, {rank_log(999_999)!r}), "w") as f:  # a rank the job does not have
    f.write("a row the service would keep for rank 999999\\n")
print("rank 0's own words", flush=True)
""" + WAIT_FOR_END
BYSTANDER = "import os; open(os.path.join(os.environ['ETT_CHECKPOINT_DIR'], 'ran'), 'w').close()\n"


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Cluster, Path]]:
    """The service and one agent started as root; the scripts in a folder every user may read."""
    with open_folder("ett-hostile-") as root:
        python = job_python(root / "job-python")
        scripts = root / "scripts"
        scripts.mkdir()
        for name, text in {"nested.py": NESTED_LINE, "socket.py": SOCKET_FOLDER, "sparse.py": SPARSE_FILES,
                           "far_rank.py": FAR_RANK_LOG, "bystander.py": BYSTANDER}.items():
            (scripts / name).write_text(text)
        with cluster(root) as c:
            c.start_agent("node-a", slots=1, job_python=python)
            yield c, python


def run(c: Cluster, owner: httpx.Client, python: Path, script: str, *args: str, **spec) -> str:
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


def test_a_line_nested_past_any_parser_and_then_a_cancel(node):
    c, python = node
    job_id = run(c, c.user, python, "nested.py")
    wait_for(lambda: (checkpoint_dir(c, "alice", job_id) / "done").exists(), 120, "the nested line written")
    assert c.user.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
    assert c.wait_job(job_id, timeout=60)["state"] == "cancelled", c.logs()
    the_agent_lives_and_another_owners_job_succeeds(c, python)


def test_a_folder_where_the_warm_servers_socket_goes_then_the_server_killed(node):
    c, python = node
    job_id = run(c, c.user, python, "socket.py", warm_imports=["json"])
    c.wait_job(job_id, timeout=120)  # its rank goes with the server it killed, or ends first: either way
    assert (checkpoint_dir(c, "alice", job_id) / "done").exists(), c.logs()  # forked warm, it did its harm
    the_agent_lives_and_another_owners_job_succeeds(c, python)
    # The owner's next job of the kind starts fresh while the server cannot start, and succeeds.
    again = run(c, c.user, python, "bystander.py", warm_imports=["json"])
    assert c.wait_job(again, timeout=120)["state"] == "succeeded", c.logs()


def test_output_of_a_rank_the_job_does_not_have_is_refused(node):
    c, python = node
    job_id = run(c, c.user, python, "far_rank.py")
    wait_for(lambda: (checkpoint_dir(c, "alice", job_id) / "done").exists(), 120, "the far rank's log written")
    # Its own rank's output arrives; the far rank's is refused whole (a row per rank and attempt
    # would let a job fill the service's database by naming ranks).
    wait_for(lambda: "rank 0's own words" in c.user.get(f"/api/v1/jobs/{job_id}/logs", params={"rank": 0}).json()
             .get("text", ""), 60, "rank 0's output shipped")  # fmt: skip
    with c.service.context.sessions() as session:
        assert session.scalars(select(RankLog.rank).where(RankLog.job_id == job_id)).all() == [0]
    (checkpoint_dir(c, "alice", job_id) / "end").touch()
    assert c.wait_job(job_id, timeout=60)["state"] == "succeeded", c.logs()
    the_agent_lives_and_another_owners_job_succeeds(c, python)


def rss_bytes(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith(field + ":")).split()[1]) * 1024


def test_three_hundred_sparse_terabyte_spools_cost_the_agent_at_most_64_mib(node):
    c, python = node
    agent = c.agents["node-a"].pid
    before = rss_bytes(agent, "VmRSS")
    job_id = run(c, c.user, python, "sparse.py", "300")
    dead_letters = c.root / "node-a" / "dead-letters.jsonl"

    def set_aside() -> int:  # each spool's endless line, once, its rest skipped unread
        text = dead_letters.read_text() if dead_letters.exists() else ""
        lines = text.split("\n")[:-1]  # whole lines: the agent may be writing the last
        return len({json.loads(line)["file"] for line in lines if job_id in line})

    wait_for(lambda: set_aside() >= 300, 120, "every sparse spool read past")
    grown = rss_bytes(agent, "VmHWM") - before
    print(f"the agent grew by {grown / 2**20:.1f} MiB")
    assert grown <= 64 << 20, f"the agent grew by {grown >> 20} MiB"
    (checkpoint_dir(c, "alice", job_id) / "end").touch()
    assert c.wait_job(job_id, timeout=60)["state"] == "succeeded", c.logs()
    the_agent_lives_and_another_owners_job_succeeds(c, python)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
