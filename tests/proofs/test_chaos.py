"""Chaos: real processes (service, agents, torchrun ranks) and real faults, one proof each.

The measured figures (detection and recovery times) are printed, and docs/reliability.md quotes
them; run with `-s` to see them. The fake rank (tests/agent/scripts/fake_rank.py) stands in for
the trainer where checkpoints play no part, the `tiny` trainer where they do.
"""

import os
import signal
import time

import pytest

from tests.proofs.cluster import cluster, fake_rank_job, wait_for

pytestmark = pytest.mark.slow

STEPS, STEP_SECONDS = 40, 0.1


def rank_events(c, job_id: str) -> list[tuple]:
    return sorted((e.attempt, e.source, e.seq, e.kind) for e in c.events(job_id) if e.source.startswith("rank:"))


def fake_rank_timeline(attempt: int = 0, steps: int = STEPS) -> list[tuple]:
    """What the fake rank writes in a run: per rank init_start, init_end, (rank 0) steps, train_end."""
    rank0 = ["init_start", "init_end", *["step"] * steps, "train_end"]
    rank1 = ["init_start", "init_end", "train_end"]
    return sorted([(attempt, "rank:0", i, k) for i, k in enumerate(rank0)]
                  + [(attempt, "rank:1", i, k) for i, k in enumerate(rank1)])  # fmt: skip


def test_service_killed_and_restarted_mid_job_loses_and_doubles_nothing(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agent("node-0")
        job_id = c.submit(fake_rank_job(steps=STEPS, step_seconds=STEP_SECONDS))
        wait_for(lambda: len(c.events(job_id, kind="step")) >= 5, 60, "the first steps to be stored")
        c.kill_service()
        killed = time.monotonic()
        time.sleep(2)  # the ranks go on stepping; the agent keeps their events in its spool
        c.start_service()
        down = time.monotonic() - killed
        job = c.wait_job(job_id)
        caught_up = time.monotonic() - killed
        report = c.report(job_id)
    print(f"\nservice down {down:.1f} s; job done and every event stored {caught_up:.1f} s after the kill")
    assert job["state"] == "succeeded" and len(job["attempts"]) == 1
    # Every event the ranks wrote is stored exactly once...
    assert rank_events(c, job_id) == fake_rank_timeline()
    # ...and counted once: the productive time is the steps' own durations.
    assert report["seconds"]["productive"] == pytest.approx(STEPS * STEP_SECONDS)
    assert report["failures"] == []


def test_agent_killed_mid_job_node_lost_within_deadline_and_job_moves_to_spare(tmp_path):
    timeout = 5.0
    with cluster(tmp_path, ETT_HEARTBEAT_TIMEOUT_SECONDS=timeout) as c:
        agents = {name: c.start_agent(name) for name in ("node-0", "node-1")}
        job_id = c.submit(fake_rank_job(steps=60, step_seconds=STEP_SECONDS))
        wait_for(lambda: len(c.events(job_id, kind="step")) >= 5, 60, "the first steps to be stored")
        [first] = c.job(job_id)["attempts"][0]["nodes"]
        spare = ({"node-0", "node-1"} - {first}).pop()
        rank_pids = [e.data["pid"] for e in c.events(job_id, kind="init_start")]
        agents[first].send_signal(signal.SIGKILL)  # the daemon dies; its ranks must not outlive it
        killed_at = time.time()
        failed = wait_for(lambda: c.events(job_id, kind="attempt_failed"), 3 * timeout, "the attempt to fail")
        detected = failed[0].ts - killed_at
        job = c.wait_job(job_id)
        report = c.report(job_id)
    print(f"\nnode lost {detected:.1f} s after its agent was killed (heartbeat timeout {timeout:g} s); "
          f"time to recover {report['failures'][0]['time_to_recover_seconds']:.1f} s")
    assert failed[0].data["cause"] == "node_lost" and first in failed[0].data["detail"]
    assert timeout <= detected <= timeout + 3  # the deadline, plus a scheduler period and a heartbeat
    assert job["state"] == "succeeded" and [a["nodes"] for a in job["attempts"]] == [[first], [spare]]
    assert not [pid for pid in rank_pids if _alive(pid)], "ranks of the dead agent are still running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
