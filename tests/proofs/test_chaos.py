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
    # The default heartbeat deadline (30 s): an outage shorter than it must not cost a restart.
    # (A longer one does: on restart the scheduler sees every node silent for longer than the
    # deadline and declares them lost; docs/reliability.md.)
    with cluster(tmp_path, ETT_HEARTBEAT_TIMEOUT_SECONDS=30) as c:
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


def tiny_job(name: str, checkpoint_dir, steps: int, interval: int, faults: list[dict]) -> dict:
    return {"name": name, "nodes": 1, "procs_per_node": 2, "max_restarts": 2, "faults": faults,
            "trainer": {"preset": "tiny", "overrides": {"train.steps": steps}},
            "checkpoint": {"interval_steps": interval, "keep": 3, "dir": str(checkpoint_dir)}}  # fmt: skip


def test_rank_killed_while_checkpoint_is_written_resumes_from_the_previous_committed(tmp_path):
    # Rank 1 is SIGKILLed the moment rank 0 reports step 8, whose checkpoint then starts.
    kill = {"attempt": 0, "rank": 1, "at_step": 8, "action": "kill"}
    with cluster(tmp_path) as c:
        c.start_agent("node-0")
        job_id = c.submit(tiny_job("ckpt-kill", tmp_path / "ckpt", steps=12, interval=4, faults=[kill]))
        job = c.wait_job(job_id, timeout=180)
        committed = {(e.attempt, e.step) for e in c.events(job_id, kind="ckpt_committed", source="rank:0")}
        restored = c.events(job_id, kind="restore_end", source="rank:0")
        report = c.report(job_id)
    print(f"\ncommitted (attempt, step): {sorted(committed)}; attempt 1 restored step "
          f"{[e.step for e in restored]}; failure: {report['failures']}")
    assert job["state"] == "succeeded" and len(job["attempts"]) == 2
    assert (0, 4) in committed and (0, 8) not in committed  # step 8's save never completed
    assert job["attempts"][1]["resume_from"].endswith("step-00000004")
    assert [(e.attempt, e.step) for e in restored] == [(1, 4)]
    assert report["failures"][0]["cause"] == "signal" and report["failures"][0]["lost_steps"] >= 4


def test_corrupt_newest_checkpoint_is_skipped_and_resume_falls_back_saying_so(tmp_path):
    fail = {"attempt": 0, "rank": 1, "at_step": 10, "action": "exit", "code": 1}
    checkpoints = tmp_path / "ckpt"
    with cluster(tmp_path, ETT_RESTART_BACKOFF_SECONDS=2) as c:
        c.start_agent("node-0")
        job_id = c.submit(tiny_job("ckpt-corrupt", checkpoints, steps=12, interval=4, faults=[fail]))
        wait_for(lambda: c.job(job_id)["attempts"][0]["state"] == "failed", 120, "attempt 0 to fail")
        # Between the attempts (the restart backoff), one shard of the newest checkpoint rots.
        shard = sorted((checkpoints / "step-00000008").glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        job = c.wait_job(job_id, timeout=180)
        restored = c.events(job_id, kind="restore_end", source="rank:0")
        logs = "\n".join(c.logs().values())
    assert job["state"] == "succeeded"
    # The service offered the newest committed checkpoint; the trainer found it corrupt, said so
    # and went back to the one before.
    assert job["attempts"][1]["resume_from"].endswith("step-00000008")
    assert [(e.attempt, e.step) for e in restored] == [(1, 4)]
    assert f"skipping checkpoint {checkpoints / 'step-00000008'}: {shard.name} fails its CRC-32 check" in logs
