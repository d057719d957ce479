"""A node lost to its peers (service/jobs/peer_loss.py): which failure texts implicate which node,
how the silent one is chosen when the text names none, and the rule driven tick by tick with a
controlled clock on both databases: lost for the job and fenced only when a survivor lost its
connection and the node stayed silent after its stop; never for a node that answers, a failure of
the node's own, or while the service has just come back. A fenced node's late events, a checkpoint's
commit among them, are refused through the agents' batch writer: never a resume point."""

import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from ett.protocol import HEARTBEAT_RETRY_MAX_SECONDS
from service.agents import commands
from service.jobs import peer_loss, scheduler
from service.jobs.checkpoints import newest_checkpoint
from service.failures.failure_text import DEFAULT_COMPILED, read_lines
from service.models import (ACTIVE_ATTEMPT_STATES, AttemptNode, AttemptState, Job, JobEvent, Node, NodeEvidence,
                            NodeState, RankLog, Role, Token, utcnow)
from service.schemas.agents import AttemptReport
from service.settings import Settings
from tests.service.factories import job_spec, submit
from tests.service.ingest.test_event_batches import agent, post_together
from tests.service.ingest.test_ingest_bad_events import good

T0 = 1_700_000_000.0
GLOO = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [{}]:15024"
NCCL = ("torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
        "ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version 2.21.5")
STORE = "torch.distributed.DistStoreError: failed to recv, got 0 bytes"
C10D = "sendBytes failed on SocketImpl(fd=3, addr=[10.0.0.1]:57252, remote=[10.0.0.0]:29517): Broken pipe"


def at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


@pytest.mark.parametrize("line, kind", [
    (GLOO.format("127.0.0.1"), "peer_lost"),
    ("[rank1]: RuntimeError: Read error [10.0.0.2]:5678: Connection reset by peer", "peer_lost"),
    (NCCL, "peer_lost"),
    (STORE, "peer_lost"),
    (C10D, "peer_lost"),
    # A job's own download reset, with no peer's [address]:port, is the job's exception.
    ("requests.exceptions.ConnectionError: ('Connection aborted.', 'Connection reset by peer')", "exception"),
    ("ValueError: bad batch", "exception"),
])  # fmt: skip
def test_a_survivors_lost_connection_is_read_as_peer_lost(line, kind):
    assert read_lines(["Traceback (most recent call last):", line], DEFAULT_COMPILED).kind == kind


def shares_on(*addresses: str) -> list[AttemptNode]:
    return [AttemptNode(node=Node(name=f"n{rank}", address=address), node_rank=rank)
            for rank, address in enumerate(addresses)]  # fmt: skip


@pytest.mark.parametrize("summary, addresses, chosen", [
    (GLOO.format("10.0.0.2"), ("10.0.0.0", "10.0.0.1", "10.0.0.2"), [2]),  # the address it names
    (NCCL, ("10.0.0.0", "10.0.0.1", "10.0.0.2"), [0, 1, 2]),  # none named: silence tells
    (GLOO.format("127.0.0.1"), ("127.0.0.1",) * 3, [0, 1, 2]),  # one machine: every node has it
    (GLOO.format("10.9.9.9"), ("10.0.0.0", "10.0.0.1"), [0, 1]),  # an address of none of them
    (STORE, ("10.0.0.0", "10.0.0.1", "10.0.0.2"), [0]),  # the store: the master's
    (C10D, ("10.0.0.0", "10.0.0.1", "10.0.0.2"), [0]),  # the store's port
])  # fmt: skip
def test_which_node_a_survivors_text_implicates(summary, addresses, chosen):
    shares = shares_on(*addresses)
    assert [s.node_rank for s in peer_loss.implicated(summary, 29517, shares)] == chosen


def test_the_masters_store_lost_while_the_master_answered_falls_back_to_the_others():
    shares = shares_on("10.0.0.0", "10.0.0.1", "10.0.0.2")[1:]  # node rank 0 has reported its end
    assert [s.node_rank for s in peer_loss.implicated(STORE, 29517, shares)] == [1, 2]


def started(session: Session, settings: Settings, names: str, nodes: int = 2) -> tuple[Job, dict[str, Node]]:
    """A job of `nodes` nodes running on the first of `names` (the rest spares), every node heard at T0."""
    token = Token(subject="agents", role=Role.agent, token_hash=uuid.uuid4().hex)
    session.add(token)
    session.flush()
    fleet = {n: Node(name=n, address="127.0.0.1", slots=2, token_id=token.id, last_heartbeat_at=at(T0))
             for n in names}  # fmt: skip
    session.add_all(fleet.values())
    job = Job(id=uuid.uuid4().hex, name="j", owner="alice", spec=job_spec(nodes=nodes))
    session.add(job)
    session.commit()
    scheduler.tick(session, settings, T0)
    session.commit()
    assert [s.node.name for s in job.attempts[0].nodes] == list(names[:nodes])
    for node in fleet.values():
        commands.take_pending(session, node.id)
    for share in job.attempts[0].nodes:
        share.state = AttemptState.running
    session.commit()
    return job, fleet


def fails(session: Session, node: Node, job: Job, rank: int, now: float, last_line: str) -> None:
    """The node's share fails: its rank's output (as its agent shipped it) ends with `last_line`."""
    session.add(RankLog(job_id=job.id, attempt=0, rank=rank, node=node.name, text=f"step 7\n{last_line}\n"))
    node.last_heartbeat_at = at(now)
    report = AttemptReport(job_id=job.id, attempt=0, state="failed", cause="exit", detail=f"rank {rank} exit code 1",
                           exit_code=1)  # fmt: skip
    scheduler.on_reports(session, node, [report], now)
    session.commit()


def heard(*nodes_at: tuple[Node, float]) -> None:
    for node, ts in nodes_at:
        node.last_heartbeat_at = at(ts)


def tick(session: Session, settings: Settings, now: float, up_since: float | None = None) -> None:
    scheduler.tick(session, settings, now, up_since)
    session.commit()


def test_a_silent_node_its_peers_lost_is_lost_for_the_job_fenced_and_replaced_at_once(session, settings):
    job, n = started(session, settings, "abc")
    fails(session, n["a"], job, 0, T0 + 10, GLOO.format("127.0.0.1"))
    attempt = job.attempts[0]
    assert (attempt.state, attempt.diagnosis) == (AttemptState.failed, "peer_lost")
    heard((n["a"], T0 + 10.3), (n["c"], T0 + 10.3))  # b, last heard at T0, stays silent
    tick(session, settings, T0 + 10 + settings.peer_loss_grace_seconds / 2)
    assert len(job.attempts) == 1, "b may yet report a failure of its own"
    # Past the grace, the spare takes b's rank at once (no restart backoff for a node lost to its peers)...
    tick(session, settings, T0 + 10 + settings.peer_loss_grace_seconds)
    session.refresh(job)
    assert [s.node.name for s in job.attempts[1].nodes] == ["a", "c"]
    # ... while b's silence window goes on: not yet lost nor fenced, its share still held.
    b_share = attempt.nodes[1]
    assert n["b"].state == NodeState.busy and not n["b"].fenced and b_share.state == AttemptState.running

    tick(session, settings, T0 + 10 + settings.peer_loss_silence_seconds)
    session.refresh(job)
    assert (attempt.cause, attempt.diagnosis) == ("node_lost", "node_lost"), attempt.detail
    said = f"sent no heartbeat for {settings.peer_loss_silence_seconds:g} s after its peers lost their"
    assert said in attempt.detail
    assert n["b"].state == NodeState.lost and n["b"].fenced and b_share.fenced_at is not None
    assert b_share.state == AttemptState.failed
    assert len(job.attempts) == 2 and job.attempts[1].state in ACTIVE_ATTEMPT_STATES  # the new attempt goes on
    [evidence] = session.scalars(select(NodeEvidence).where(NodeEvidence.node_id == n["b"].id)).all()
    assert evidence.kind == "node_lost"


def test_the_scheduler_ticks_when_the_grace_and_the_window_end_and_the_survivors_are_killed_at_once(session, settings):
    """The decisions of a node loss fall due between the scheduler's periods: each tick says when the
    next one does (service/asgi/background.py waits for no more). The silent node's stop kills at once."""
    job, n = started(session, settings, "abc")
    fails(session, n["a"], job, 0, T0 + 10, GLOO.format("127.0.0.1"))
    [stop] = commands.take_pending(session, n["b"].id)
    assert stop["at_once"] is True, "a broken attempt's survivors have nothing to save"
    grace, window = settings.peer_loss_grace_seconds, settings.peer_loss_silence_seconds
    assert scheduler.tick(session, settings, T0 + 10.01) == pytest.approx(T0 + 10 + grace)
    assert len(job.attempts) == 1
    assert scheduler.tick(session, settings, T0 + 10 + grace) == pytest.approx(T0 + 10 + window)
    session.commit()
    assert len(job.attempts) == 2
    assert scheduler.tick(session, settings, T0 + 10 + window) is None  # lost and fenced: nothing more falls due
    session.commit()
    assert n["b"].state == NodeState.lost


def test_a_stop_that_lets_a_healthy_attempt_save_is_not_at_once(session, settings):
    job, n = started(session, settings, "ab")
    scheduler.fail_attempt(session, job.attempts[0], "straggler", "rank 1 slow", T0 + 10)
    assert {stop["at_once"] for node in n.values() for stop in commands.take_pending(session, node.id)} == {False}


def test_without_a_spare_the_next_attempt_waits_for_the_silence_window(session, settings):
    job, n = started(session, settings, "ab")
    fails(session, n["a"], job, 0, T0 + 10, GLOO.format("127.0.0.1"))
    heard((n["a"], T0 + 10.1))
    tick(session, settings, T0 + 10 + settings.peer_loss_grace_seconds)
    assert len(job.attempts) == 1 and job.reason is None  # no shrinking, no waiting reason: the window decides
    tick(session, settings, T0 + 10 + settings.peer_loss_silence_seconds)
    assert n["b"].state == NodeState.lost and len(job.attempts) == 1  # now it waits for a node, as any lost one


def test_a_node_whose_own_ranks_failed_reports_within_the_grace_and_keeps_its_rank(session, settings):
    """A SIGKILLed rank's node: its peers' report comes first, its own a moment later (its agent sees the
    rank end as they see the connection close): the next attempt runs on the same nodes, not the spare."""
    job, n = started(session, settings, "abc")
    fails(session, n["a"], job, 0, T0 + 10, GLOO.format("127.0.0.1"))
    report = AttemptReport(job_id=job.id, attempt=0, state="failed", cause="signal", detail="rank 2 killed by SIGKILL")
    n["b"].last_heartbeat_at = at(T0 + 10.2)
    scheduler.on_reports(session, n["b"], [report], T0 + 10.2)
    session.commit()
    tick(session, settings, T0 + 10 + settings.restart_backoff_seconds)
    assert job.attempts[0].cause == "signal" and n["b"].fenced is None
    assert [s.node.name for s in job.attempts[1].nodes] == ["a", "b"]


def test_a_node_that_answers_its_stop_is_not_lost(session, settings):
    job, n = started(session, settings, "abc")
    fails(session, n["a"], job, 0, T0 + 10, GLOO.format("127.0.0.1"))
    heard((n["a"], T0 + 10.3), (n["b"], T0 + 10.05), (n["c"], T0 + 10.3))  # b's agent has the stop and says so
    tick(session, settings, T0 + 12)
    assert n["b"].state == NodeState.busy and n["b"].fenced is None and job.attempts[0].nodes[1].fenced_at is None
    assert len(job.attempts) == 1, "b still stops its share: waited for, as ever"


def test_a_failure_of_the_nodes_own_is_no_peer_loss(session, settings):
    job, n = started(session, settings, "abc")
    fails(session, n["a"], job, 0, T0 + 10, "ValueError: bad batch")  # b silent, but nobody lost a peer
    tick(session, settings, T0 + 15)
    assert n["b"].state == NodeState.busy and n["b"].fenced is None
    # Not lost: given the next attempt (killed at once, the old ranks; its agent holds the launch till they are gone).
    assert [s.node.name for s in job.attempts[1].nodes] == ["a", "b"]


def test_the_nodes_own_failure_told_after_a_survivors_peer_lost_names_the_cause(session, settings):
    job, n = started(session, settings, "abc")
    fails(session, n["a"], job, 0, T0 + 10, GLOO.format("127.0.0.1"))
    fails(session, n["b"], job, 2, T0 + 10.2, "ValueError: bad batch")  # b reported: it is not silent
    tick(session, settings, T0 + 12)
    attempt = job.attempts[0]
    assert (attempt.diagnosis, attempt.summary) == ("exception", "ValueError: bad batch")
    assert n["b"].fenced is None and n["b"].state != NodeState.lost


def test_the_silent_one_is_lost_when_the_text_names_no_node(session, settings):
    job, n = started(session, settings, "abcd", nodes=3)
    fails(session, n["a"], job, 0, T0 + 10, NCCL)
    heard((n["a"], T0 + 10.3), (n["b"], T0 + 10.1), (n["d"], T0 + 10.3))  # b answers its stop, c does not
    tick(session, settings, T0 + 11)
    assert n["b"].fenced is None and n["b"].state == NodeState.busy
    assert n["c"].fenced and n["c"].state == NodeState.lost
    assert job.attempts[0].cause == "node_lost"


def test_no_silence_is_counted_while_the_agents_may_still_back_off_from_the_services_outage(session, settings):
    job, n = started(session, settings, "abc")
    fails(session, n["a"], job, 0, T0 + 10, GLOO.format("127.0.0.1"))
    heard((n["a"], T0 + 10.3), (n["c"], T0 + 10.3))
    back = T0 + 9  # the service came back just before the failure
    tick(session, settings, T0 + 12, up_since=back)
    assert n["b"].fenced is None and n["b"].state == NodeState.busy  # the next attempt went on on the spare
    tick(session, settings, back + HEARTBEAT_RETRY_MAX_SECONDS + settings.peer_loss_silence_seconds, up_since=back)
    assert n["b"].fenced and n["b"].state == NodeState.lost


def test_a_fenced_node_that_comes_back_is_told_to_stop_first_and_takes_no_work_until_it_has(session, settings):
    job, n = started(session, settings, "abc")
    fails(session, n["a"], job, 0, T0 + 10, GLOO.format("127.0.0.1"))
    heard((n["a"], T0 + 10.3), (n["c"], T0 + 10.3))
    tick(session, settings, T0 + 11)
    b = n["b"]
    [stop] = commands.take_pending(session, b.id)  # queued at the failure, handed to a dead connection
    assert (stop["type"], stop["attempt"]) == ("stop", 0)
    session.commit()
    # b comes back still running attempt 0: told to stop it again, and no work meanwhile.
    running = AttemptReport(job_id=job.id, attempt=0, state="running")
    assert peer_loss.answer_fenced(session, b, [running], pending=False)
    assert not peer_loss.answer_fenced(session, b, [running], pending=True)  # one stop waiting is enough
    b.state, b.last_heartbeat_at = NodeState.idle, at(T0 + 12)
    other = Job(id=uuid.uuid4().hex, name="k", owner="alice", spec=job_spec(nodes=1))
    session.add(other)
    session.commit()
    tick(session, settings, T0 + 12)
    assert commands.take_pending(session, b.id) == [
        {"type": "stop", "job_id": job.id, "attempt": 0, "reason": "fenced: this node was declared lost for it",
         "at_once": True}]
    assert other.attempts == [] and b.fenced, "a fenced node takes no new work"
    # Its agent stopped them: the fence is lifted, and the node takes work.
    stopped = AttemptReport(job_id=job.id, attempt=0, state="stopped")
    assert not peer_loss.answer_fenced(session, b, [stopped], pending=False)
    assert b.fenced is None
    session.commit()
    tick(session, settings, T0 + 13)
    assert [s.node.name for s in other.attempts[0].nodes] == ["b"]
    assert job.attempts[0].nodes[1].fenced_at is not None, "what b sends of attempt 0 stays refused"


def test_a_fenced_nodes_late_events_are_refused_and_its_late_commit_is_never_a_resume_point(service):
    job = submit(service.client(service.token("user")), nodes=2)["id"]
    b = agent(service, "node-b", job)

    def event(seq: int, **change) -> dict:
        return good(seq, **change) | {"job_id": job}

    def commit(seq: int, step: int) -> dict:
        return event(seq, kind="ckpt_committed", step=step, data={"path": f"/ckpt/step-{step}", "verified": True})

    [before] = post_together(service, [("node-b", b, [event(0), commit(1, 5)])])
    assert (before.accepted, before.refused) == (2, 0)
    with service.context.sessions() as session:
        assert newest_checkpoint(session, job) == "/ckpt/step-5"
        # Its peers declared it lost for attempt 0 (the rule's tests are above): fenced from it.
        share = session.scalars(select(AttemptNode).join(Node).where(Node.name == "node-b")).one()
        share.fenced_at = utcnow()
        session.commit()
    [late] = post_together(service, [("node-b", b, [event(2), commit(3, 10)])])
    assert (late.accepted, late.duplicates, late.refused) == (0, 0, 2)  # answered: its forwarder goes on
    with service.context.sessions() as session:
        assert newest_checkpoint(session, job) == "/ckpt/step-5"
        stored = session.scalars(select(JobEvent.seq).where(JobEvent.job_id == job).order_by(JobEvent.seq)).all()
    assert stored == [0, 1]
