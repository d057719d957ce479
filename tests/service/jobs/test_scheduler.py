"""The scheduler's decisions, driven tick by tick with a controlled clock on both databases."""

import time
import uuid

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from ett.protocol.messages import command_adapter
from service.agents import commands
from service.jobs import scheduler
from service.models import (
    AgentCommand,
    Attempt,
    AttemptState,
    Checkpoint,
    Job,
    JobEvent,
    JobState,
    Node,
    NodeState,
    RankLog,
    Role,
    Token,
    utcnow,
)
from service.schemas.agents import AttemptReport
from service.settings import Settings
from tests.service.factories import job_spec

T0 = 1_700_000_000.0


def add_nodes(session: Session, *names: str, slots: int = 2) -> list[Node]:
    token = Token(subject="agents", role=Role.agent, token_hash=uuid.uuid4().hex)
    session.add(token)
    session.flush()
    nodes = [Node(name=n, address=f"10.0.0.{i}", slots=slots, token_id=token.id) for i, n in enumerate(names)]
    session.add_all(nodes)
    session.commit()
    return nodes


def add_job(session: Session, **overrides) -> Job:
    job = Job(id=uuid.uuid4().hex, name="j", owner="alice", spec=job_spec(**overrides))
    session.add(job)
    session.commit()
    return job


def tick(session: Session, settings: Settings, now: float) -> None:
    for node in session.scalars(select(Node)):
        if node.state != NodeState.lost:
            node.last_heartbeat_at = utcnow()  # every node is alive unless a test says otherwise
    scheduler.tick(session, settings, now)
    session.commit()


def taken(session: Session, node: Node) -> list[dict]:
    out = commands.take_pending(session, node.id)
    session.commit()
    return out


def report(session: Session, node: Node, job: Job, attempt: int, state: str, now: float, **extra) -> None:
    scheduler.on_reports(session, node, [AttemptReport(job_id=job.id, attempt=attempt, state=state, **extra)], now)
    session.commit()


def test_gang_allocation_waits_for_all_nodes(session, settings):
    (a,) = add_nodes(session, "a")
    job = add_job(session)
    tick(session, settings, T0)
    assert job.state == JobState.queued and taken(session, a) == []
    (b,) = add_nodes(session, "b")
    tick(session, settings, T0 + 1)
    session.refresh(job)
    assert job.state == JobState.running and len(job.attempts) == 1
    launches = [taken(session, a), taken(session, b)]
    assert [len(x) for x in launches] == [1, 1]
    first, second = launches[0][0], launches[1][0]
    assert (first["node_rank"], second["node_rank"]) == (0, 1)
    assert first["master_addr"] == second["master_addr"] == a.address
    assert first["master_port"] == second["master_port"] and first["nnodes"] == 2
    assert first["checkpoint"]["resume_from"] is None
    # The job's own folder, in its owner's area, which the agent checks again at launch.
    area = settings.resolved_checkpoint_root / "alice"
    assert first["checkpoint"]["dir"] == str(area / job.id) and first["checkpoint"]["area"] == str(area)
    assert {a.state, b.state} == {NodeState.busy}


def test_a_job_without_hang_detection_launches_without_it(session, settings):
    (a,) = add_nodes(session, "a")
    add_job(session, nodes=1, hang_timeout_seconds=None, entrypoint=["python", "train.py"])
    tick(session, settings, T0)
    [launch] = taken(session, a)
    assert launch["hang_timeout_seconds"] is None
    # The agent reads it as "no hang detection", not as a launch it cannot read.
    assert command_adapter.validate_python(launch).hang_timeout_seconds is None


def test_failure_kills_the_others_and_restarts_on_the_same_nodes_without_waiting_for_them(session, settings):
    a, b = add_nodes(session, "a", "b")
    job = add_job(session, faults=[{"attempt": 1, "rank": 3, "at_step": 4, "action": "kill", "code": None}])
    tick(session, settings, T0)
    taken(session, a), taken(session, b)
    report(session, b, job, 0, "running", T0 + 1)
    report(session, a, job, 0, "failed", T0 + 5, cause="exit", detail="rank 1 exit code 1", exit_code=1)
    session.refresh(job)
    assert job.attempts[0].state == AttemptState.failed and job.attempts[0].cause == "exit"
    # Node b still runs the old attempt's ranks, killed at once: the next attempt is given it all the same,
    # its launch queued after the stop, which the agent carries out first (and holds the launch until then).
    tick(session, settings, T0 + 5.5 + settings.restart_backoff_seconds)  # no checkpoint yet: its backoff
    session.refresh(job)
    assert len(job.attempts) == 2 and job.restarts == 1
    stop, relaunch_b = taken(session, b)
    assert stop == {"type": "stop", "job_id": job.id, "attempt": 0, "reason": "attempt failed", "at_once": True}
    [relaunch_a] = taken(session, a)
    assert (relaunch_a["attempt"], relaunch_a["node_rank"], relaunch_b["node_rank"]) == (1, 0, 1)
    assert relaunch_b["faults"] == [job.spec.faults[0].model_dump()] and relaunch_a["faults"] == []
    # The old share's end leaves node b to the new attempt; its end frees it.
    report(session, b, job, 0, "failed", T0 + 6, cause="signal", detail="rank 3 killed by SIGKILL")
    session.refresh(b)
    assert b.state == NodeState.busy and job.attempts[0].cause == "signal"  # a root cause still corrects the record
    report(session, a, job, 1, "succeeded", T0 + 9)
    report(session, b, job, 1, "succeeded", T0 + 9)
    session.refresh(b), session.refresh(job)
    assert b.state == NodeState.idle and job.state == JobState.succeeded


def test_the_next_attempt_waits_for_node_rank_0_whose_end_may_bring_the_newest_commit(session, settings):
    """Rank 0 commits the checkpoints: its node's end, reported once its events are in, may bring a commit
    the next attempt must be named to resume from, so that share is waited for even when killed at once."""
    a, b = add_nodes(session, "a", "b")
    job = add_job(session)
    tick(session, settings, T0)
    report(session, a, job, 0, "running", T0 + 1)
    report(session, b, job, 0, "failed", T0 + 5, cause="signal", detail="rank 3 killed by SIGKILL")
    tick(session, settings, T0 + 5.5 + settings.restart_backoff_seconds)
    session.refresh(job)
    assert len(job.attempts) == 1 and a.state == NodeState.busy
    report(session, a, job, 0, "failed", T0 + 6, cause="exit", detail="rank 1 exit code 1", exit_code=1)
    tick(session, settings, T0 + 6.5 + settings.restart_backoff_seconds)
    session.refresh(job)
    assert len(job.attempts) == 2


@pytest.mark.parametrize("end", ["straggler", "peer_lost"])
def test_the_next_attempt_waits_for_nodes_that_save_or_that_may_be_dead(session, settings, end):
    """A straggler's replacement lets the ranks save (a SIGTERM, a grace): the checkpoint is the next
    attempt's; a survivor's lost connection may name a dead node among those still running."""
    a, b, c = add_nodes(session, "a", "b", "c")
    job = add_job(session)
    tick(session, settings, T0)
    report(session, a, job, 0, "running", T0 + 1)
    report(session, b, job, 0, "running", T0 + 1)
    if end == "straggler":
        scheduler.fail_attempt(session, job.attempts[0], "straggler", "node b is slow", T0 + 5, node=b)
    else:
        text = "RuntimeError: [pair.cc:537] Read error [10.0.0.1]:29500: Connection reset by peer"
        session.add(RankLog(job_id=job.id, attempt=0, rank=0, node="a", text=f"step 7\n{text}\n"))
        report(session, a, job, 0, "failed", T0 + 5, cause="exit", detail="rank 0 exit code 1", exit_code=1)
    session.commit()
    stops = [s for s in taken(session, a) + taken(session, b) if s["type"] == "stop"]
    assert all(not s["at_once"] for s in stops) if end == "straggler" else job.attempts[0].diagnosis == "peer_lost"
    tick(session, settings, T0 + 5.5 + settings.restart_backoff_seconds)
    session.refresh(job)
    assert len(job.attempts) == 1 and b.state == NodeState.busy


def test_the_killed_rank_names_the_cause_when_its_peer_reports_first(session, settings):
    a, b = add_nodes(session, "a", "b")
    job = add_job(session)
    tick(session, settings, T0)
    report(session, b, job, 0, "failed", T0 + 5, cause="exit", detail="rank 2 exit code 1", exit_code=1)
    report(session, a, job, 0, "failed", T0 + 6, cause="signal", detail="rank 1 killed by SIGKILL")
    session.refresh(job)
    attempt = job.attempts[0]
    assert (attempt.cause, attempt.detail) == ("signal", "rank 1 killed by SIGKILL")
    failed = session.scalars(select(JobEvent).where(JobEvent.kind == "attempt_failed")).all()
    assert [(e.ts, e.data["cause"]) for e in failed] == [(T0 + 5, "exit"), (T0 + 5, "signal")]
    report(session, a, job, 0, "failed", T0 + 7, cause="exit", detail="late", exit_code=1)  # never demoted
    session.refresh(job)
    assert job.attempts[0].cause == "signal" and job.restarts == 0


def test_configuration_error_is_not_retried(session, settings):
    a, b = add_nodes(session, "a", "b")
    job = add_job(session)
    tick(session, settings, T0)
    report(session, a, job, 0, "failed", T0 + 2, cause="exit", detail="rank 0 exit code 3", exit_code=3)
    report(session, b, job, 0, "stopped", T0 + 3)
    tick(session, settings, T0 + 30)
    session.refresh(job)
    assert job.state == JobState.failed and "configuration error" in job.reason and len(job.attempts) == 1


@pytest.mark.parametrize("code, retried", [(42, False), (1, True)])
def test_a_jobs_own_no_retry_exit_codes_fail_it_at_once(session, settings, code, retried):
    a, b = add_nodes(session, "a", "b")
    job = add_job(session, no_retry_exit_codes=[42, 43])
    tick(session, settings, T0)
    report(session, a, job, 0, "failed", T0 + 2, cause="exit", detail=f"rank 0 exit code {code}", exit_code=code)
    report(session, b, job, 0, "stopped", T0 + 3)
    tick(session, settings, T0 + 30)
    session.refresh(job)
    if retried:
        assert job.state == JobState.running and len(job.attempts) == 2
    else:
        assert job.state == JobState.failed and len(job.attempts) == 1
        assert job.reason == "exit code 42 is in the job's no_retry_exit_codes, not retried: rank 0 exit code 42"


def test_max_restarts_is_honoured(session, settings):
    a, b = add_nodes(session, "a", "b")
    job = add_job(session, max_restarts=1)
    now = T0
    for attempt in range(2):
        tick(session, settings, now)
        report(session, a, job, attempt, "failed", now + 1, cause="exit", exit_code=1)
        report(session, b, job, attempt, "stopped", now + 2)
        now += 10
    tick(session, settings, now)
    session.refresh(job)
    assert job.state == JobState.failed and len(job.attempts) == 2 and "after 1 restarts" in job.reason


@pytest.mark.parametrize("committed", [False, True])
def test_the_restart_backoff_is_only_for_attempts_that_committed_no_checkpoint(session, settings, committed):
    (a,) = add_nodes(session, "a")
    job = add_job(session, nodes=1)
    tick(session, settings, T0)
    if committed:
        session.add(Checkpoint(job_id=job.id, attempt=0, step=5, committed_at=T0 + 3, path="/ckpt/step-00000005"))
    report(session, a, job, 0, "failed", T0 + 5, cause="signal", detail="rank 1 killed by SIGKILL")
    tick(session, settings, T0 + 5)
    session.refresh(job)
    assert len(job.attempts) == (2 if committed else 1)  # a crash loop waits; progress restarts at once
    tick(session, settings, T0 + 5.5 + settings.restart_backoff_seconds)
    session.refresh(job)
    assert len(job.attempts) == 2


def test_lost_node_is_replaced_by_a_spare(session, settings):
    a, b, spare = add_nodes(session, "a", "b", "c-spare")
    job = add_job(session)
    tick(session, settings, T0)
    assert {s.node.name for s in job.attempts[0].nodes} == {"a", "b"}
    report(session, a, job, 0, "running", T0 + 1)
    # b's heartbeats stop: past the timeout the scheduler declares it lost (no refresh this tick).
    b.last_heartbeat_at = utcnow().replace(year=2000)
    session.commit()
    scheduler.tick(session, settings, time.time())
    session.commit()
    session.refresh(job)
    assert b.state == NodeState.lost and job.attempts[0].cause == "node_lost"
    report(session, a, job, 0, "stopped", time.time())
    tick(session, settings, time.time() + settings.restart_backoff_seconds + 1)
    session.refresh(job)
    assert [s.node.name for s in job.attempts[1].nodes] == ["a", "c-spare"]


@pytest.mark.parametrize("names, lost", [("abc", "a"), ("abc", "b"), ("abc", "c"), ("abcd", "a"), ("abcd", "c"),
                                         ("abcd", "d")])
def test_a_spare_takes_the_lost_nodes_rank_and_the_survivors_keep_theirs(session, settings, names, lost):
    """Peers keep snapshot copies by rank (ett/snapshots/peers.py): a survivor's rank never shifts,
    whichever node went (rank 0's, a middle one, the last), in jobs of 3 and 4 nodes. The spare
    sorts first by name: order alone would put it at rank 0."""
    nodes = {n.name: n for n in add_nodes(session, *names, "0-spare")}
    nodes["0-spare"].drained = "kept out of the first attempt"
    session.commit()
    job = add_job(session, nodes=len(names))
    tick(session, settings, T0)
    assert [s.node.name for s in sorted(job.attempts[0].nodes, key=lambda s: s.node_rank)] == list(names)
    nodes["0-spare"].drained = None
    nodes[lost].last_heartbeat_at = utcnow().replace(year=2000)
    session.commit()
    scheduler.tick(session, settings, time.time())
    session.commit()
    for name in set(names) - {lost}:
        report(session, nodes[name], job, 0, "stopped", time.time())
    tick(session, settings, time.time() + settings.restart_backoff_seconds + 1)
    session.refresh(job)
    expected = ["0-spare" if name == lost else name for name in names]
    assert [s.node.name for s in sorted(job.attempts[1].nodes, key=lambda s: s.node_rank)] == expected
    assert job.attempts[1].master_addr == nodes[expected[0]].address


def test_cancel_stops_every_node(session, settings):
    a, b = add_nodes(session, "a", "b")
    job = add_job(session)
    tick(session, settings, T0)
    taken(session, a), taken(session, b)
    scheduler.cancel_job(session, job, T0 + 5)
    session.commit()
    assert job.state == JobState.cancelled and job.attempts[0].state == AttemptState.stopped
    assert [c["type"] for c in taken(session, a) + taken(session, b)] == ["stop", "stop"]
    report(session, a, job, 0, "stopped", T0 + 6)
    report(session, b, job, 0, "stopped", T0 + 6)
    assert {a.state, b.state} == {NodeState.idle}


def test_success_of_every_node_finishes_the_job(session, settings):
    a, b = add_nodes(session, "a", "b")
    job = add_job(session)
    tick(session, settings, T0)
    report(session, a, job, 0, "succeeded", T0 + 50)
    assert job.state == JobState.running
    report(session, b, job, 0, "succeeded", T0 + 51)
    assert job.state == JobState.succeeded and {a.state, b.state} == {NodeState.idle}
    assert session.scalar(select(AgentCommand).where(AgentCommand.delivered_at.is_(None))).payload["type"] == "launch"
    assert session.scalar(select(Attempt)).state == AttemptState.succeeded
