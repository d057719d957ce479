"""A rank's output, end to end: real agents and torchrun ranks print, the agent ships it, and
`ett logs` shows a failed rank's traceback (the job's secret blanked), follows a running rank
line by line, and the job page shows the failed rank's last lines beside its failure."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.browser import chromium
from tests.support.cluster import cluster
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow
ETT = str(Path(sys.executable).parent / "ett")
# Rank 1 fails once rank 0 has said hello (a mark in the node-local folder both ranks share): else,
# on a loaded machine, rank 0 was once ended before its first line.
FAILING = """
import os, sys, time
rank = int(os.environ["RANK"])
said = os.path.join(os.environ["ETT_CHECKPOINT_LOCAL_DIR"], "rank-0-said-hello")
print(f"hello from rank {rank}, key {os.environ['WANDB_API_KEY']}", flush=True)
if rank == 0:
    open(said, "w").close()
    time.sleep(30)
deadline = time.monotonic() + 60
while not os.path.exists(said) and time.monotonic() < deadline:
    time.sleep(0.05)
raise ValueError("bad batch")
"""
CHATTY = """
import os, time
for i in range(12):
    print(f"rank {os.environ['RANK']} line {i}", flush=True)
    time.sleep(0.5)
"""


def ett_logs(c, job_id: str, *args: str, **popen) -> subprocess.Popen:
    env = os.environ | {"ETT_SERVICE_URL": c.service.url, "ETT_TOKEN": c.service.token("user", "alice")}
    return subprocess.Popen([ETT, "logs", job_id, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def test_ett_logs_shows_the_failed_ranks_traceback_and_follows_a_running_rank(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agent("node-a")
        failing = c.submit(name="failing", nodes=1, procs_per_node=2, max_restarts=0,
                           env={"WANDB_API_KEY": "s3cr3t-key-123"}, entrypoint=[sys.executable, "-c", FAILING])
        job = c.wait_job(failing)
        assert job["state"] == "failed" and "rank 1" in job["attempts"][0]["detail"], job
        out, err = ett_logs(c, failing).communicate(timeout=60)  # the failed rank's, by default
        assert "Traceback (most recent call last)" in out and "ValueError: bad batch" in out, (out, err)
        assert "hello from rank 1, key [redacted]" in out and "s3cr3t-key-123" not in out
        # The agent ships output beside its events, not with the failure's report: rank 0's may come after.
        wait_for(lambda: "hello from rank 0" in c.user.get(f"/api/v1/jobs/{failing}/logs", params={"rank": 0})
                 .json()["text"], 30, "rank 0's output to be shipped")  # fmt: skip
        out, _ = ett_logs(c, failing, "--rank", "0").communicate(timeout=60)
        assert out.startswith("hello from rank 0") and "Traceback" not in out

        # The job page in a real browser: the failed rank's last lines under its failure.
        url = f"{c.service.url}/jobs/{failing}?token={c.service.token('user', 'alice')}"
        page = chromium("--dump-dom", url, profile=tmp_path / "browser")
        assert 'class="rank-log" data-attempt="0" data-rank="1"' in page and "ValueError: bad batch" in page

        chatty = c.submit(name="chatty", nodes=1, procs_per_node=2, max_restarts=0, hang_timeout_seconds=None,
                          entrypoint=[sys.executable, "-c", CHATTY])
        wait_for(lambda: c.job(chatty)["state"] == "running", 60, "the chatty job to run")
        follow = ett_logs(c, chatty, "--rank", "1", "--follow")
        lines, seen_at = [], 0.0
        for line in follow.stdout:  # line by line as they come, until the command ends with the job
            seen_at = seen_at or time.monotonic()
            lines.append(line)
        assert follow.wait(timeout=60) == 0
        assert [line.strip() for line in lines] == [f"rank 1 line {i}" for i in range(12)], lines
        assert c.job(chatty)["state"] == "succeeded"
        # The first line came while the rank still printed (12 lines, 0.5 s apart), not at the end.
        assert time.monotonic() - seen_at > 2.0


# The rank prints its secret in two writes, flushing the first and waiting (for the test's word)
# before the second: the agent ships the first meanwhile.
SPLIT_SECRET = """
import os, sys, time
key, go_on = os.environ["WANDB_API_KEY"], os.environ["GO_ON_FILE"]
sys.stdout.write("starting\\nkey " + key[:7]); sys.stdout.flush()
deadline = time.monotonic() + 60
while not os.path.exists(go_on) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.stdout.write(key[7:] + " in two writes\\n"); sys.stdout.flush()
"""


def test_a_secret_a_rank_prints_in_two_writes_is_blanked_on_its_node_before_shipping(tmp_path):
    """The service blanks a secret within each piece it is shipped; one split between two pieces is
    blanked on the node, where the rank's output is read: its start is kept back until the rest comes."""
    go_on = tmp_path / "go-on"
    with cluster(tmp_path) as c:
        c.start_agent("node-a")
        job_id = c.submit(name="split", nodes=1, procs_per_node=1, max_restarts=0, hang_timeout_seconds=None,
                          env={"WANDB_API_KEY": "s3cr3t-key-123", "GO_ON_FILE": str(go_on)},
                          entrypoint=[sys.executable, "-c", SPLIT_SECRET])  # fmt: skip

        def shipped() -> str | None:
            return c.user.get(f"/api/v1/jobs/{job_id}/logs", params={"rank": 0}).json().get("text")

        wait_for(lambda: shipped() == "starting\nkey ", 90, "the rank's first write to be shipped")
        time.sleep(1.0)  # the agent ships every 0.1 s: the secret's start, had it not been kept back, would be there
        assert shipped() == "starting\nkey "
        go_on.touch()
        assert c.wait_job(job_id)["state"] == "succeeded"
        wait_for(lambda: shipped() == "starting\nkey [redacted] in two writes\n", 30, "the rest to be shipped")
        out, err = ett_logs(c, job_id).communicate(timeout=60)
        assert out == "starting\nkey [redacted] in two writes\n", (out, err)
        on_node = b"".join(p.read_bytes() for p in (tmp_path / "node-a").rglob("rank-0.log*"))
        assert b"key [redacted] in two writes" in on_node and b"s3cr3t-" not in on_node
