"""Event forwarding: exactly once through outages and agent restarts, dead letters, spool upkeep."""

import json
import os
import signal
import threading
import time

import pytest

from agent.client import ServiceClient
from agent.files.beneath import remove_tree
from agent.files.spool import AttemptPaths, disk_bytes
from agent.forwarding.delivery import rejected_indices
from agent.forwarding.forward import ForwardConfig, Forwarder
from agent.node.metrics import AgentStats
from agent.settings import AgentSettings
from ett.protocol import ENDED_MARKER, EVENTS_DIR, rank_spool
from tests.agent.fake_service import FakeService
from tests.agent.helpers import free_port
from tests.proofs.cluster import cluster, fake_rank_job
from tests.support.processes import pids_with_env
from tests.support.waiting import wait_for


@pytest.fixture
def fake_service():
    service = FakeService(free_port()).start()
    yield service
    service.stop()


def spool_event(seq, kind="step", source="rank:0"):
    return {"kind": kind, "ts": 1.0 + seq, "attempt": 0, "source": source, "seq": seq, "step": seq, "data": {}}


def write_spool(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def forwarder_for(service, tmp_path, **config):
    client = ServiceClient(AgentSettings(service_url=service.url, token="t", name="node-a", data_dir=tmp_path))
    return Forwarder(tmp_path / "spool", tmp_path, client.post_events, AgentStats(), ForwardConfig(**config))


def test_refused_events_go_to_the_dead_letter_file_and_the_rest_arrives(fake_service, tmp_path):
    spool = tmp_path / "spool" / "job1" / "0" / EVENTS_DIR / rank_spool(0)
    write_spool(spool, [spool_event(0), spool_event(1, kind="bogus"), "{not json", spool_event(3), spool_event(4)])
    forwarder = forwarder_for(fake_service, tmp_path)

    assert forwarder.forward_once(flush=True)

    assert sorted(key[3] for key in fake_service.events) == [0, 3, 4]
    assert all(event["job_id"] == "job1" for event in fake_service.events.values())
    dead = [json.loads(line) for line in (tmp_path / "dead-letters.jsonl").read_text().splitlines()]
    assert [d["line"] for d in dead] == ["{not json", json.dumps(spool_event(1, kind="bogus"))]
    assert "unknown kind 'bogus'" in json.dumps(dead[1]["error"])
    assert forwarder.stats.dead_letters == 2 and forwarder.stats.events_forwarded == 3
    offsets = json.loads((tmp_path / "forward-offsets.json").read_text())
    assert offsets == {f"job1/0/{EVENTS_DIR}/{rank_spool(0)}": spool.stat().st_size}


def test_a_refusal_naming_no_event_is_bisected_down_to_the_bad_one(fake_service, tmp_path, monkeypatch):
    monkeypatch.setattr(fake_service, "_ingest", lambda events, real=fake_service._ingest: (
        (422, {"detail": "batch refused"}) if any(e["kind"] == "bogus" for e in events) else real(events)))
    write_spool(tmp_path / "spool" / "j" / "0" / EVENTS_DIR / rank_spool(0),
                [spool_event(i, kind="bogus" if i == 5 else "step") for i in range(8)])
    forwarder = forwarder_for(fake_service, tmp_path)

    assert forwarder.forward_once(flush=True)

    assert sorted(key[3] for key in fake_service.events) == [0, 1, 2, 3, 4, 6, 7]
    assert forwarder.stats.dead_letters == 1


def test_while_the_service_is_down_nothing_moves_and_backoff_grows(fake_service, tmp_path):
    write_spool(tmp_path / "spool" / "j" / "0" / EVENTS_DIR / rank_spool(0), [spool_event(i) for i in range(3)])
    fake_service.stop()
    forwarder = forwarder_for(fake_service, tmp_path, retry_base_seconds=1.0, retry_max_seconds=8.0)

    delays = []
    for _ in range(6):
        assert not forwarder.forward_once(flush=True)
        delays.append(forwarder._backoff())
    assert not (tmp_path / "forward-offsets.json").exists()
    assert forwarder.stats.forward_failures == 6 and forwarder.stats.events_buffered == 3
    for failures, delay in enumerate(delays, start=1):
        limit = min(8.0, 2 ** (failures - 1))
        assert limit / 2 <= delay <= limit

    fake_service.start()
    assert forwarder.forward_once(flush=True)
    assert len(fake_service.events) == 3 and forwarder.stats.events_buffered == 0


@pytest.mark.parametrize("status", [500, 503, 429])
def test_an_error_or_busy_answer_is_not_taken_as_delivered(fake_service, tmp_path, monkeypatch, status):
    """A 5xx (the service failing) or 429 (its rate limit) keeps every event: nothing is marked
    forwarded, set aside or acknowledged, and all of them arrive once the service answers again."""
    answers = {"refuse": True}
    monkeypatch.setattr(fake_service, "_ingest", lambda events, real=fake_service._ingest: (
        (status, {"detail": "try later"}) if answers["refuse"] else real(events)))
    spool = tmp_path / "spool" / "j" / "0" / EVENTS_DIR / rank_spool(0)
    write_spool(spool, [spool_event(i) for i in range(5)])
    forwarder = forwarder_for(fake_service, tmp_path)

    for _ in range(3):
        assert not forwarder.forward_once(flush=True)
    assert fake_service.events == {} and forwarder.stats.events_forwarded == 0
    assert forwarder.stats.dead_letters == 0 and not (tmp_path / "dead-letters.jsonl").exists()
    assert not (tmp_path / "forward-offsets.json").exists() and forwarder.stats.events_buffered == 5

    answers["refuse"] = False
    assert forwarder.forward_once(flush=True)
    assert sorted(key[3] for key in fake_service.events) == [0, 1, 2, 3, 4]
    assert forwarder.stats.events_forwarded == 5 and forwarder.stats.events_repeated == 0
    assert json.loads((tmp_path / "forward-offsets.json").read_text()) == {
        f"j/0/{EVENTS_DIR}/{rank_spool(0)}": spool.stat().st_size}


def test_an_ended_attempt_spool_is_deleted_once_forwarded(fake_service, tmp_path):
    ended = AttemptPaths.of(tmp_path / "spool", "done", 0)
    running = AttemptPaths.of(tmp_path / "spool", "live", 0)
    write_spool(ended.events_dir / rank_spool(0), [spool_event(i) for i in range(3)])
    write_spool(running.events_dir / rank_spool(0), [spool_event(i) for i in range(3)])
    ended.ended_marker.write_text("succeeded")
    forwarder = forwarder_for(fake_service, tmp_path)

    assert forwarder.forward_once(flush=True)
    assert forwarder.forward_once(flush=True)  # sees the ended spool forwarded

    assert len(fake_service.events) == 6
    assert not ended.root.exists() and running.events_dir.exists()
    assert (tmp_path / "finished" / "done" / "0" / ENDED_MARKER).read_text() == "succeeded"  # logs kept apart
    assert forwarder.stats.spool_bytes == disk_bytes(running.events_dir / rank_spool(0))
    assert forwarder.stats.backlog_bytes == 0
    assert json.loads((tmp_path / "forward-offsets.json").read_text()) == {
        f"live/0/{EVENTS_DIR}/{rank_spool(0)}": (running.events_dir / rank_spool(0)).stat().st_size}


def test_the_forwarded_start_of_a_live_spool_gives_its_disk_back(fake_service, tmp_path):
    spool = tmp_path / "spool" / "live" / "0" / EVENTS_DIR / rank_spool(0)
    write_spool(spool, [spool_event(i) | {"data": {"pad": "x" * 900}} for i in range(4500)])  # about 4.4 MiB
    forwarder = forwarder_for(fake_service, tmp_path, batch_max_events=1000)

    assert forwarder.forward_once(flush=True)
    assert forwarder.forward_once(flush=True)  # counts the disk used after the release
    size = spool.stat().st_size
    assert size > 4 << 20 and disk_bytes(spool) <= size - (2 << 20)
    assert forwarder.stats.spool_bytes == disk_bytes(spool)

    write_spool(spool, [spool_event(i) for i in range(4500, 4510)])
    restarted = forwarder_for(fake_service, tmp_path)  # reads on from the persisted position, past the hole
    assert restarted.forward_once(flush=True)
    assert len(fake_service.events) == 4510 and fake_service.duplicates == 0


def test_flush_sends_what_is_written_without_waiting_for_a_batch(fake_service, tmp_path):
    forwarder = forwarder_for(fake_service, tmp_path, batch_max_age_seconds=3600.0)
    stop = threading.Event()
    thread = threading.Thread(target=forwarder.run, args=(stop,))
    thread.start()
    try:
        write_spool(tmp_path / "spool" / "j" / "0" / EVENTS_DIR / rank_spool(0), [spool_event(i) for i in range(3)])
        time.sleep(0.3)  # a few of the thread's polls: it reads the lines and holds them for the batch
        assert fake_service.events == {}
        assert forwarder.flush(timeout=10.0)
        assert len(fake_service.events) == 3
        fake_service.stop()
        write_spool(tmp_path / "spool" / "j" / "0" / EVENTS_DIR / rank_spool(0), [spool_event(3)])
        assert not forwarder.flush(timeout=0.5)  # the service is down: the caller is not held longer
    finally:
        stop.set()
        forwarder.wake()
        thread.join(30)


def test_a_flush_tries_again_at_once_when_the_forwarder_is_in_backoff(fake_service, tmp_path):
    # An attempt's end is reported once its events are in (agent.groups.report_book.ReportBook): after an
    # outage the reporter's flush must not wait out the forwarder's backoff (here a minute).
    forwarder = forwarder_for(fake_service, tmp_path, retry_base_seconds=120.0, retry_max_seconds=120.0)
    stop = threading.Event()
    thread = threading.Thread(target=forwarder.run, args=(stop,))
    fake_service.stop()
    write_spool(tmp_path / "spool" / "j" / "0" / EVENTS_DIR / rank_spool(0), [spool_event(i) for i in range(3)])
    thread.start()
    try:
        assert not forwarder.flush(timeout=0.5)  # down: it fails and backs off
        assert forwarder.failures >= 1
        fake_service.start()
        started = time.monotonic()
        assert forwarder.flush(timeout=30.0)
        assert time.monotonic() - started < 30.0 and len(fake_service.events) == 3
    finally:
        stop.set()
        forwarder.wake()
        thread.join(30)


def test_rejected_indices_reads_fastapi_locs_and_messages():
    assert rejected_indices({"detail": [{"loc": ["body", "events", 3, "kind"], "msg": "bad"}]}) == {3}
    assert rejected_indices({"detail": "events.12.seq: must be >= 0; events.2.kind: unknown"}) == {2, 12}
    assert rejected_indices({"detail": "too large"}) == set()


@pytest.mark.slow
def test_service_outage_and_agent_crash_lose_and_repeat_nothing(tmp_path):
    """The real service goes down mid-job, the agent crashes, a new agent starts, the service
    comes back: every spooled event is stored once, and only the batch in flight is resent."""
    with cluster(tmp_path) as c:
        first = c.start_agent("node-a", ETT_AGENT_BATCH_MAX_EVENTS="20")
        job_id = c.submit(fake_rank_job(steps=100000, step_seconds=0.01, max_restarts=0))
        wait_for(lambda: len(c.events(job_id)) >= 50, 120, "events to flow")
        c.kill_service()
        paths = AttemptPaths.of(tmp_path / "node-a" / "spool", job_id, 0)
        spooled = paths.events_dir / rank_spool(0)
        size = spooled.stat().st_size
        wait_for(lambda: spooled.stat().st_size > size + 2000, 30, "events to pile up while the service is down")
        first.send_signal(signal.SIGKILL)  # a crash: no goodbye, read positions as they were
        first.wait()
        wait_for(lambda: not pids_with_env("ETT_JOB_ID", job_id), 15, "the workers to die with their agent")

        c.start_agent("node-a", ETT_AGENT_BATCH_MAX_EVENTS="20")  # the same data dir; the service is still down
        wait_for(lambda: paths.ended_marker.exists(), 60, "the restarted agent to close the dead attempt")
        lines = [json.loads(line) for f in sorted([*paths.events_dir.glob("*.jsonl"), *paths.root.glob("*.jsonl")])
                 for line in f.read_text().splitlines()]
        c.start_service()
        wait_for(lambda: not paths.root.exists(), 60, "the backlog to be forwarded and the spool retired")

        stored = {(e.attempt, e.source, e.seq) for e in c.events(job_id) if e.source != "service"}
        assert len(lines) > 60
        assert stored == {(e["attempt"], e["source"], e["seq"]) for e in lines}
        stats = wait_for(lambda: (n := c.node("node-a")).stats.get("events_buffered") == 0 and n.stats, 30,
                         "a heartbeat after the backlog")
        assert stats["events_repeated"] <= 20  # at most the one batch in flight when the first agent died
        assert c.job(job_id)["attempts"][0]["state"] == "failed"


def test_a_jobs_folder_link_or_endless_line_stays_with_that_job(fake_service, tmp_path):
    """What a job lays in its events folder (a folder named like a spool, a link or a hard link to
    a root-only file, a FIFO, a line of 100 MB without a newline) neither stops forwarding for the
    others, nor is read through the link, nor blocks, nor is read without a bound."""
    secret = tmp_path / "root-only"
    secret.write_text("root:$6$secret-hash:19000:0:99999:7:::\n")
    secret.chmod(0o600)
    bad = tmp_path / "spool" / "bad" / "0" / EVENTS_DIR
    write_spool(bad / rank_spool(0), [spool_event(0)])
    (bad / "x.jsonl").mkdir()
    (bad / rank_spool(1)).symlink_to(secret)
    endless = bad / rank_spool(2)
    endless.write_bytes(b"{" + b"a" * (100 << 20))  # never ends: no newline
    os.link(secret, bad / rank_spool(3))  # as root here; a job needs protected_hardlinks off
    os.mkfifo(bad / rank_spool(4))
    write_spool(tmp_path / "spool" / "good" / "0" / EVENTS_DIR / rank_spool(0), [spool_event(i) for i in range(3)])
    forwarder = forwarder_for(fake_service, tmp_path)

    assert forwarder.forward_once(flush=True)

    delivered = sorted((e["job_id"], e["seq"]) for e in fake_service.events.values())
    assert delivered == [("bad", 0), ("good", 0), ("good", 1), ("good", 2)]
    dead = [json.loads(line) for line in (tmp_path / "dead-letters.jsonl").read_text().splitlines()]
    # The endless line, cut at the bound: set aside once, kept short, the rest of it skipped unread.
    assert [(d["file"], d["bytes"]) for d in dead] == [(f"bad/0/{EVENTS_DIR}/{rank_spool(2)}", (100 << 20) + 1)]
    assert all(len(d["line"]) <= 4096 for d in dead)
    assert "secret-hash" not in (tmp_path / "dead-letters.jsonl").read_text()
    assert oct((tmp_path / "dead-letters.jsonl").stat().st_mode & 0o777) == "0o600"


def test_a_ranks_events_say_only_what_a_rank_may_and_a_commit_is_checked_on_disk(fake_service, tmp_path):
    """The agent stamps job, attempt and source from where a line was found; a `ckpt_committed` is
    a resume point only if its folder, inside the job's checkpoint folder, has a marker of its
    step listing files that are there (agent/checkpoints/checkpoint_check.py)."""
    from ett.checkpoints.folders import folder_manifest, step_folder, write_marker
    from ett.protocol.messages import LaunchCommand
    from tests.agent.helpers import launch_command

    ckpt = tmp_path / "ckpt" / "job"
    good = step_folder(ckpt, 5)
    good.mkdir(parents=True)
    (good / "__0_0.distcp").write_bytes(b"x" * 100)
    write_marker(good, 5, 1, folder_manifest(good))
    torn = step_folder(ckpt, 6)
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"x" * 10)
    write_marker(torn, 6, 1, {"__0_0.distcp": {"bytes": 100, "crc32": 0}})  # a file shorter than listed
    linked = step_folder(ckpt, 7)
    linked.symlink_to(good)  # the good one, through a link the agent does not follow
    attempt = tmp_path / "spool" / "job" / "0"
    command: LaunchCommand = launch_command(job_id="job", checkpoint={"dir": str(ckpt)})
    attempt.mkdir(parents=True)
    AttemptPaths(attempt).launch_file.write_text(command.model_dump_json())

    def commit(seq, step, path):
        return spool_event(seq, "ckpt_committed") | {"step": step, "data": {"path": str(path), "verified": True}}

    write_spool(attempt / EVENTS_DIR / rank_spool(0), [
        commit(0, 5, good), commit(1, 6, torn), commit(2, 7, linked), commit(3, 8, step_folder(ckpt, 8)),
        commit(4, 9, "/etc"), commit(5, 6, good),  # no folder; outside the job's; the marker of another step
        spool_event(6, source="node:node-b") | {"attempt": 3},  # a rank posing as a node, and another attempt
    ])
    assert forwarder_for(fake_service, tmp_path).forward_once(flush=True)

    by_seq = {e["seq"]: e for e in fake_service.events.values()}
    assert [by_seq[seq]["data"]["verified"] for seq in range(6)] == [True, False, False, False, False, False]
    assert (by_seq[6]["source"], by_seq[6]["attempt"], by_seq[6]["job_id"]) == ("rank:0", 0, "job")


@pytest.mark.slow
def test_a_forged_commit_is_no_resume_point(tmp_path):
    """A rank says step 5 was committed, with no such checkpoint on disk (and `verified` set by
    itself): the real service counts the event but does not resume the restart from it."""
    with cluster(tmp_path) as c:
        c.start_agent("node-a")
        spec = fake_rank_job(steps=10, max_restarts=1)
        spec["entrypoint"] += ["--forge-commit", "5", "--fail-rank", "0", "--fail-at-step", "7"]
        job_id = c.submit(spec)
        job = c.wait_job(job_id)
        assert len(job["attempts"]) == 2, job["attempts"]
        first, second = job["attempts"]
        assert first["cause"] == "exit" and second["resume_from"] is None, job
        [commit] = [e for e in c.events(job_id) if e.kind == "ckpt_committed" and e.attempt == 0]
        assert commit.step == 5 and commit.data["verified"] is False


def test_a_tree_deeper_than_python_recurses_is_removed_and_no_link_in_it_followed(tmp_path):
    """Root removes the job's folders (its events, its node-local checkpoints) whatever the job put
    there: 1,100 nested folders (shutil.rmtree's recursion ended the agent) and a link to outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_text("root's")
    job = tmp_path / "job"
    job.mkdir()
    fd = os.open(job, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1_100):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.symlink(outside, "out", dir_fd=fd)
    os.close(fd)
    remove_tree(job)
    assert not job.exists() and (outside / "kept").read_text() == "root's"


def test_a_number_no_json_can_carry_is_set_aside_and_the_rest_forwarded(fake_service, tmp_path):
    # Python reads NaN, Infinity and 1e400, and no JSON encoder writes them: sent, such an event
    # failed every batch of the node for good (found by review).
    spool = tmp_path / "spool" / "job1" / "0" / EVENTS_DIR / rank_spool(0)
    lines = [json.dumps(spool_event(0))]
    for seq, number in enumerate(("NaN", "Infinity", "-Infinity", "1e400"), 1):
        lines.append(json.dumps(spool_event(seq)).replace('"data": {}', f'"data": {{"bad": {number}}}'))
    write_spool(spool, [*lines, spool_event(5)])
    forwarder = forwarder_for(fake_service, tmp_path)

    assert forwarder.forward_once(flush=True)

    assert sorted(key[3] for key in fake_service.events) == [0, 5]
    assert forwarder.stats.dead_letters == 4


def launched(tmp_path, job_id: str, ranks: int) -> AttemptPaths:
    """An attempt's spool folder with its launch file, as the agent writes it (its world: `ranks`)."""
    paths = AttemptPaths.of(tmp_path / "spool", job_id, 0)
    paths.events_dir.mkdir(parents=True)
    paths.launch_file.write_text(json.dumps({
        "type": "launch", "job_id": job_id, "attempt": 0, "node_rank": 0, "nnodes": 1, "nproc_per_node": ranks,
        "master_addr": "127.0.0.1", "master_port": 29500, "entrypoint": ["python"]}))  # fmt: skip
    return paths


def test_spools_of_ranks_beyond_the_world_are_set_aside_unread_with_one_dead_letter(fake_service, tmp_path):
    paths = launched(tmp_path, "many", 2)
    for rank in range(3000):  # each a rank the job does not have but ranks 0 and 1
        write_spool(paths.events_dir / rank_spool(rank), [spool_event(0, source=f"rank:{rank}")])
    write_spool(paths.events_dir / "rank-01.jsonl", [spool_event(1, source="rank:1")])  # not rank 1's name
    forwarder = forwarder_for(fake_service, tmp_path)
    assert forwarder.forward_once(flush=True) and forwarder.forward_once(flush=True)
    assert sorted(key[2] for key in fake_service.events) == ["rank:0", "rank:1"]
    [note] = [json.loads(line) for line in (tmp_path / "dead-letters.jsonl").read_text().splitlines()]
    assert note["file"] == f"many/0/{EVENTS_DIR}" and "2998 spools of ranks beyond" in note["error"]
    paths.ended_marker.write_text("succeeded")
    assert forwarder.forward_once(flush=True)
    assert not paths.root.exists()  # retired: what was set aside holds no spool on the node


def test_one_jobs_backlog_holds_neither_another_jobs_events_nor_its_flush(fake_service, tmp_path):
    """Alice's job floods its spool; Bob's job, after hers in every order the forwarder reads, has a
    few events and its end waits for them (a flush of its attempt): they arrive, and the flush is
    answered, while Alice's are still on their way."""
    alice, bob = launched(tmp_path, "alice", 1), launched(tmp_path, "bob", 1)
    write_spool(alice.events_dir / rank_spool(0), [spool_event(i) for i in range(5000)])
    write_spool(bob.events_dir / rank_spool(0), [spool_event(i) for i in range(3)])
    forwarder = forwarder_for(fake_service, tmp_path, batch_max_events=100)
    stop = threading.Event()
    thread = threading.Thread(target=forwarder.run, args=(stop,))
    thread.start()
    try:
        assert forwarder.flush(timeout=60.0, attempts=[("bob", 0)])
        arrived = list(fake_service.events)  # in the order they arrived
        assert [key for key in arrived if key[0] == "bob"] == [("bob", 0, "rank:0", i) for i in range(3)]
        assert forwarder.flush(timeout=120.0)
        arrived = list(fake_service.events)
        assert len(arrived) == 5003
        # Bob's events came in the first batches, not after Alice's 5,000.
        assert max(arrived.index(("bob", 0, "rank:0", i)) for i in range(3)) < 300
    finally:
        stop.set()
        forwarder.wake()
        thread.join(30)


LEASE = """
import fcntl, os, signal, sys, time
signal.signal(signal.SIGIO, signal.SIG_IGN)  # a lease break is told with SIGIO: the job keeps its lease
fd = os.open(sys.argv[1], os.O_WRONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)  # any other open of the file now fails or waits
print("held", flush=True)
time.sleep(60)
"""


def test_a_lease_on_a_spool_is_said_in_roots_log_once_an_interval_not_every_pass(fake_service, tmp_path, caplog):
    """A job's process holds a write lease on its spool: each pass of the forwarder fails to open it
    (EAGAIN); root's log says so once, then how many more, not 10 lines a second for the job's life."""
    import subprocess
    import sys

    spool = tmp_path / "spool" / "job1" / "0" / EVENTS_DIR / rank_spool(0)
    write_spool(spool, [spool_event(0)])
    holder = subprocess.Popen([sys.executable, "-c", LEASE, str(spool)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        forwarder = forwarder_for(fake_service, tmp_path)
        with caplog.at_level("WARNING", logger="agent.forwarding.spool_files"):
            for _ in range(50):
                forwarder.forward_once(flush=False)
        said = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
        assert len(said) == 1 and "Resource temporarily unavailable" in said[0], said
    finally:
        holder.kill()
        holder.wait()
    forwarder.forward_once(flush=True)  # the lease gone with its holder: the spool is read
    assert [key[3] for key in fake_service.events] == [0]
