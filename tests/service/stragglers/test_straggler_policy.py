"""The `replace` policy (service/stragglers/policy.py) on both databases, driven pass by pass: the
scheduler's ticks and the straggler watch (service/stragglers/watch.py) over step timings stored
through the service's own ingestion. It replaces a straggler only where a spare is free, a restart
remains after it and the slowness did not follow the rank; otherwise the attempt goes on where it
runs and says why. With real agents and ranks: tests/e2e/recovery/test_stragglers.py."""

import time

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from ett.events import make_event
from service.accounting.accounts import job_report
from service.db import make_engine, make_session_factory
from service.ingest.store import ingest_trusted
from service.models import Attempt, AttemptState, Job, JobState, Node, StragglerFlag
from service.stragglers.watch import Watch
from tests.service.jobs.test_scheduler import add_job, add_nodes, report, tick

STEP = 1.0  # a healthy step: half of it work, half waiting at the synchronisation


@pytest.fixture
def sessions(settings):
    engine = make_engine(settings.resolved_database_url)
    yield make_session_factory(engine)
    engine.dispose()


def started(session: Session, settings, names: list[str], now: float, **spec) -> tuple[Job, list[Node]]:
    nodes = add_nodes(session, *names, slots=1)
    job = add_job(session, nodes=2, procs_per_node=1, **{"stragglers": "replace"} | spec)
    tick(session, settings, now)
    attempt = job.attempts[-1]
    for share in attempt.nodes:
        report(session, share.node, job, attempt.number, "running", now)
    return job, nodes


def steps(session: Session, job: Job, attempt: int, now: float, first: int, last: int, slow_from: int | None,
          factor: float = 3.0, total: int = 1000) -> None:
    """Rank 0's steps first..last and both ranks' windows of five, rank 1's work `factor` times its
    peer's from `slow_from` (its peer waits for it: the step is longer too), as the ranks write them."""
    events, seq = [], 10_000 * attempt + first
    for step in range(first, last + 1):
        slow = slow_from is not None and step >= slow_from
        duration = STEP / 2 * factor + STEP / 2 if slow else STEP
        events.append(make_event("step", now + step, attempt, "rank:0", seq + step, step, {"duration": duration}))
        if step % 5 == 0:
            for rank in (0, 1):
                work = STEP / 2 * (factor if slow and rank == 1 else 1.0)
                events.append(make_event("step_timing", now + step, attempt, f"rank:{rank}", 100_000 + seq + step,
                                         step, {"steps": 5, "duration": duration, "work": work, "work_low": work,
                                                "total_steps": total}))  # fmt: skip
    ingest_trusted(session, job.id, events)
    session.commit()


def watched(watch: Watch, session: Session, sessions, settings, now: float) -> list:
    """Two passes of the watch in its own sessions, as the service runs them (the second records what
    the first found); the test's session then reads anew. What the first found."""
    found = watch.run(sessions, settings, now)
    watch.run(sessions, settings, now)
    session.expire_all()
    return found


def stop_shares(session: Session, job: Job, now: float) -> None:
    attempt = job.attempts[-1]
    for share in attempt.nodes:
        report(session, share.node, job, attempt.number, "stopped", now)


def flags(session: Session, job: Job) -> list[StragglerFlag]:
    session.expire_all()
    return list(session.scalars(select(StragglerFlag).where(StragglerFlag.job_id == job.id)
                                .order_by(StragglerFlag.attempt)))  # fmt: skip


def test_without_a_spare_and_with_one_restart_the_job_goes_on_where_it_runs_and_says_why(session, settings, sessions):
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, (a, b) = started(session, settings, ["a", "b"], now, max_restarts=1)
    steps(session, job, 0, now, 1, 30, slow_from=11)
    found = watched(Watch(), session, sessions, settings, now + 40)
    assert [(s.rank, s.since_step, s.flagged_step) for s in found] == [(1, 15, 25)]
    [flag] = flags(session, job)
    assert (flag.node, flag.action, flag.follows_rank) == ("b", "kept", False)
    assert "no spare node was free" in flag.reason and "last restart (max_restarts 1)" in flag.reason
    session.refresh(job)
    assert job.attempts[-1].state == AttemptState.running and len(job.attempts) == 1
    assert job.reason.startswith("rank 1 on b straggles: 3.0x its peers' work since step 15; kept where it runs: ")
    [listed] = job_report(session, job, now + 40)["stragglers"]  # what `ett report` prints
    assert listed["action"] == "kept" and "no spare node was free" in listed["reason"]
    for node in (a, b):  # it finishes on the same nodes, in its one attempt
        report(session, node, job, 0, "succeeded", now + 50)
    session.refresh(job)
    assert job.state == JobState.succeeded and [n.node.name for n in job.attempts[0].nodes] == ["a", "b"]


def test_with_a_spare_and_restarts_to_spare_it_replaces_and_leaves_the_slow_node_out(session, settings, sessions):
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, (a, b, spare) = started(session, settings, ["a", "b", "spare"], now, max_restarts=2)
    steps(session, job, 0, now, 1, 30, slow_from=11)
    watched(Watch(), session, sessions, settings, now + 40)
    [flag] = flags(session, job)
    assert (flag.node, flag.action, flag.reason) == ("b", "replaced", None)
    session.refresh(job)
    [first] = job.attempts
    assert (first.state, first.cause, first.failed_node_id) == (AttemptState.failed, "straggler", b.id)
    assert "the slowdown would cost" in first.detail and job.state == JobState.running
    stop_shares(session, job, now + 41)
    tick(session, settings, now + 42)
    session.refresh(job)
    assert [n.node.name for n in job.attempts[1].nodes] == ["a", "spare"]  # b, the slow node, is left out


def test_with_a_spare_but_one_restart_left_it_is_kept(session, settings, sessions):
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, _ = started(session, settings, ["a", "b", "spare"], now, max_restarts=1)
    steps(session, job, 0, now, 1, 30, slow_from=11)
    watched(Watch(), session, sessions, settings, now + 40)
    [flag] = flags(session, job)
    assert flag.action == "kept" and flag.reason == "a replacement would spend the job's last restart (max_restarts 1)"


def test_a_slowdown_cheaper_than_a_restart_is_kept(session, settings, sessions):
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, _ = started(session, settings, ["a", "b", "spare"], now, max_restarts=3)
    steps(session, job, 0, now, 1, 30, slow_from=11, total=26)  # one step left: 1 s slower against a restart
    watched(Watch(), session, sessions, settings, now + 40)
    [flag] = flags(session, job)
    assert flag.action == "kept" and flag.reason.startswith("the slowdown would cost 1.0 s, a restart ")


def test_a_slowdown_that_follows_the_rank_is_replaced_once_then_kept(session, settings, sessions):
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, _ = started(session, settings, ["a", "b", "c", "d"], now, max_restarts=5)
    watch = Watch()
    steps(session, job, 0, now, 1, 30, slow_from=11)
    watched(watch, session, sessions, settings, now + 40)
    stop_shares(session, job, now + 41)
    tick(session, settings, now + 42)
    session.refresh(job)
    second = job.attempts[1]
    assert "b" not in [n.node.name for n in second.nodes]
    for share in second.nodes:
        report(session, share.node, job, 1, "running", now + 43)
    moved_to = second.nodes[1].node.name
    steps(session, job, 1, now + 50, 26, 60, slow_from=26)  # the rank's data is slow: so it is on its new node
    watched(watch, session, sessions, settings, now + 120)
    first, again = flags(session, job)
    assert (first.node, first.action) == ("b", "replaced")
    assert (again.attempt, again.node, again.action, again.follows_rank) == (1, moved_to, "kept", True)
    assert again.reason == ("rank 1 was slow on b too: the slowness follows the rank (its data or its work), "
                            "not the node")
    tick(session, settings, now + 121)
    session.refresh(job)
    assert len(job.attempts) == 2 and job.attempts[1].state == AttemptState.running  # no third node tried


def test_a_replacement_whose_spare_was_taken_meanwhile_goes_back_to_its_nodes(session, settings, sessions):
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, (a, b, spare) = started(session, settings, ["a", "b", "spare"], now, max_restarts=2)
    steps(session, job, 0, now, 1, 30, slow_from=11)
    watched(Watch(), session, sessions, settings, now + 40)
    spare.drained = "drained by admin"  # the only spare gone before the restart
    session.commit()
    stop_shares(session, job, now + 41)
    tick(session, settings, now + 42)
    session.refresh(job)
    assert [n.node.name for n in job.attempts[1].nodes] == ["a", "b"] and job.attempts[1].state != AttemptState.failed


def test_a_pass_reads_only_what_arrived_and_scores_each_window_once(session, settings, sessions):
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, _ = started(session, settings, ["a", "b"], now, stragglers="report")
    watch = Watch()
    steps(session, job, 0, now, 1, 20, slow_from=11)
    assert watched(watch, session, sessions, settings, now + 30) == []  # windows 15 and 20 slow: two, not yet three
    [attempt_id] = watch.scores
    assert watch.cursors[attempt_id][0] == 20  # read up to there: the next pass reads on from it
    steps(session, job, 0, now, 21, 25, slow_from=11)
    [found] = watched(watch, session, sessions, settings, now + 30)
    assert (found.since_step, found.flagged_step) == (15, 25)
    assert watched(watch, session, sessions, settings, now + 31) == [] and len(flags(session, job)) == 1
    [flag] = flags(session, job)
    assert (flag.action, flag.reason) == ("reported", None)
    session.execute(Attempt.__table__.update().values(state=AttemptState.succeeded))
    session.commit()
    watched(watch, session, sessions, settings, now + 32)
    assert watch.scores == {}  # an ended attempt's score is dropped
