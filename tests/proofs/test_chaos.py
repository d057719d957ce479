"""Chaos: real processes (service, agents, torchrun ranks) and real faults, one proof each.

The measured figures (detection and recovery times) are printed, and docs/reliability.md quotes
them; run with `-s` to see them. The fake rank (tests/agent/scripts/fake_rank.py) stands in for
the trainer where checkpoints play no part, the `tiny` trainer where they do.
"""

import os
import signal
import threading
import time

import pytest

from ett.protocol import MARKER
from tests.proofs.cluster import cluster, fake_rank_job
from tests.support.waiting import wait_for

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
        silent = failed[0].ts - c.node(first).last_heartbeat_at.timestamp()  # since its last heartbeat
        job = c.wait_job(job_id)
        report = c.report(job_id)
    print(f"\nnode lost {detected:.1f} s after its agent was killed, {silent:.1f} s after its last heartbeat "
          f"(deadline {timeout:g} s); time to recover {report['failures'][0]['time_to_recover_seconds']:.1f} s")
    assert failed[0].data["cause"] == "node_lost" and first in failed[0].data["detail"]
    # Not before the deadline (the rule), and long before the test gives up (3 deadlines).
    assert timeout <= silent < 3 * timeout
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
    # Rank 1 is SIGKILLed the moment rank 0 reports step 9: step 8's checkpoint has begun (its
    # save waited for step 4's commit first; a kill at step 8 itself could land before that commit
    # on a loaded machine, and did once in CI). Rank 1's shard file of step 8 is a named pipe, so
    # the write stalls like a hung disk: the kill always lands mid-write, however late the agent
    # sees step 9. The pipe is laid once step 4's save has begun: a fresh run's restore removes any
    # step folder left from before it.
    kill = {"attempt": 0, "rank": 1, "at_step": 9, "action": "kill"}
    root = tmp_path / "checkpoints" / "alice" / "ckpt"  # inside alice's area (tests/proofs/cluster.py)
    stalled = root / "step-00000008"

    def lay_pipe() -> None:
        deadline = time.monotonic() + 180
        while not (root / "step-00000004").is_dir() and time.monotonic() < deadline:
            time.sleep(0.002)
        stalled.mkdir(parents=True)
        os.mkfifo(stalled / "__1_0.distcp")

    layer = threading.Thread(target=lay_pipe, daemon=True)
    layer.start()
    with cluster(tmp_path) as c:
        c.start_agent("node-0")
        job_id = c.submit(tiny_job("ckpt-kill", root, steps=12, interval=4, faults=[kill]))
        job = c.wait_job(job_id, timeout=180)
        started = {(e.attempt, e.step) for e in c.events(job_id, kind="ckpt_start", source="rank:0")}
        committed = {(e.attempt, e.step) for e in c.events(job_id, kind="ckpt_committed", source="rank:0")}
        restored = c.events(job_id, kind="restore_end", source="rank:0")
        report = c.report(job_id)
    print(f"\nsaves started (attempt, step): {sorted(started)}, committed: {sorted(committed)}; attempt 1 restored "
          f"step {[e.step for e in restored]}; failure: {report['failures']}")
    assert job["state"] == "succeeded" and len(job["attempts"]) == 2
    assert (0, 8) in started and (0, 4) in committed and (0, 8) not in committed  # step 8's save began, never ended
    assert job["attempts"][1]["resume_from"].endswith("step-00000004")
    assert [(e.attempt, e.step) for e in restored] == [(1, 4)]
    assert report["failures"][0]["cause"] == "signal" and report["failures"][0]["lost_steps"] >= 4


def test_corrupt_newest_checkpoint_is_skipped_and_resume_falls_back_saying_so(tmp_path):
    # Saves at 5 and 10, the failure at 14: raised by the rank itself as it enters step 14 (an agent's
    # fault lands when the agent sees the step: on a loaded machine the tiny steps ran on past 15,
    # whose save then committed; seen in a fresh clone's run).
    fail = {"attempt": 0, "rank": 1, "at_step": 14, "action": "raise", "message": "rot"}
    checkpoints = tmp_path / "checkpoints" / "alice" / "ckpt"
    with cluster(tmp_path) as c:
        c.start_agent("node-0")
        job_id = c.submit(tiny_job("ckpt-corrupt", checkpoints, steps=16, interval=5, faults=[fail]))
        wait_for((checkpoints / "step-00000010" / MARKER).exists, 120, "step 10 to be committed")
        # Once it is committed, one shard of the newest checkpoint rots (not between the attempts:
        # an attempt that committed a checkpoint is restarted without a backoff).
        shard = sorted((checkpoints / "step-00000010").glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        # Put in place whole, as rot leaves a file: rewritten in place, a resume that read it meanwhile
        # would see it short ("has 0 bytes"), not corrupt.
        rotten = shard.with_name(shard.name + ".rot")
        rotten.write_bytes(bytes(data))
        rotten.replace(shard)
        job = c.wait_job(job_id, timeout=180)
        restored = c.events(job_id, kind="restore_end", source="rank:0")
        logs = "\n".join(c.logs().values())
    assert job["state"] == "succeeded"
    # The trainer never loads the corrupt checkpoint: it resumes from the one before. The service
    # offers the newest commit it has heard of: step 10, or, when the failure's report overtook the
    # rank's commit events under load (twice in CI), an older one or none, and the trainer then
    # looks through the folder itself. Whenever it came across step 10, it said why it skipped it.
    offered = job["attempts"][1]["resume_from"]
    assert offered is None or offered.endswith(("step-00000010", "step-00000005")), offered
    assert [(e.attempt, e.step) for e in restored] == [(1, 5)]
    if offered is None or offered.endswith("step-00000010"):
        said = [line for line in logs.splitlines() if "checkpoint" in line and "step-00000010" in line]
        assert f"skipping checkpoint {checkpoints / 'step-00000010'}: {shard.name} fails its CRC-32 check" in logs, said


def test_spool_over_its_bound_is_reported_and_training_goes_on(tmp_path):
    # A full disk is simulated with the agent's spool bound (ETT_AGENT_SPOOL_MAX_BYTES), far below
    # what the job writes: a read-only folder does not stop root, which runs these tests.
    bound = 1024
    with cluster(tmp_path) as c:
        c.start_agent("node-0", ETT_AGENT_SPOOL_MAX_BYTES=str(bound))
        job_id = c.submit(fake_rank_job(steps=STEPS, step_seconds=STEP_SECONDS))
        # The agent says so in its heartbeats (kept in the node's stats) and in its log.
        reported = wait_for(lambda: (c.node("node-0").stats or {}).get("spool_bytes", 0) > bound, 60,
                            "a heartbeat reporting the spool over its bound")  # fmt: skip
        job = c.wait_job(job_id)
        agent_log = (tmp_path / "node-0.log").read_text()
        report = c.report(job_id)
    assert reported and f"above their bound of {bound}" in agent_log
    assert job["state"] == "succeeded" and len(job["attempts"]) == 1  # training was not held up
    assert rank_events(c, job_id) == fake_rank_timeline()  # and every event still arrived
    assert report["seconds"]["productive"] == pytest.approx(STEPS * STEP_SECONDS)


def test_agent_clock_30_s_ahead_report_is_still_right(tmp_path):
    # ETT_AGENT_CLOCK_OFFSET_SECONDS: everything the node tells the service (its heartbeat clock,
    # its ranks' event times) reads 30 s ahead, as on a node whose clock is off.
    with cluster(tmp_path) as c:
        c.start_agent("node-0", ETT_AGENT_CLOCK_OFFSET_SECONDS="30")
        job_id = c.submit(fake_rank_job(steps=STEPS, step_seconds=STEP_SECONDS))
        job = c.wait_job(job_id)
        node = c.node("node-0")
        events = c.events(job_id)
        report = c.report(job_id)
    assert job["state"] == "succeeded"
    assert node.clock_skew_flagged and node.clock_offset_seconds == pytest.approx(-30, abs=2)
    # Every rank event was moved back onto the service's clock, inside the job's window...
    start = next(e.ts for e in events if e.kind == "attempt_allocated")
    end = next(e.ts for e in events if e.kind == "job_finished")
    ranks = [e for e in events if e.source.startswith("rank:")]
    assert all(e.clock_offset_seconds == pytest.approx(-30, abs=2) for e in ranks)
    assert all(start <= e.ts <= end for e in ranks)
    # ...so the report reads as it would on a right clock: the steps, a start-up of seconds (not
    # 30 more), categories that add up to the wall time.
    assert report["seconds"]["productive"] == pytest.approx(STEPS * STEP_SECONDS)
    # A start-up inside the job's own wall time: an uncorrected clock would put it 30 s before the job.
    assert 0 < report["time_to_start_seconds"] < report["wall_seconds"] == pytest.approx(end - start)
    assert sum(report["seconds"].values()) == pytest.approx(report["wall_seconds"])


def test_a_database_outage_longer_than_the_deadline_fails_no_attempt_and_loses_no_event(tmp_path):
    """PostgreSQL stopped for three heartbeat deadlines mid-job, then started again: no heartbeat
    could be written meanwhile, and no node is declared lost for it (the service counts silence
    from the database's return), no attempt fails, and every event arrives once."""
    from tests.support.postgres import postgres_instance

    timeout, steps = 5.0, 250
    with postgres_instance() as database, cluster(tmp_path, database.url, ETT_HEARTBEAT_TIMEOUT_SECONDS=timeout) as c:
        c.start_agent("node-0")
        job_id = c.submit(fake_rank_job(steps=steps, step_seconds=STEP_SECONDS))
        wait_for(lambda: len(c.events(job_id, kind="step")) >= 5, 60, "the first steps to be stored")
        database.stop()
        time.sleep(3 * timeout)  # the ranks go on; heartbeats and events fail and are retried
        database.start()
        c.engine.dispose()  # the test's own connections died with the server (the service's own recover)
        job = c.wait_job(job_id)
        assert job["state"] == "succeeded" and len(job["attempts"]) == 1, (job, c.logs())
        assert c.node("node-0").state == "idle"
        assert rank_events(c, job_id) == fake_rank_timeline(steps=steps)
