"""A straggler's replacement on both databases (service/stragglers/watch.py, spares.py), pass by
pass as the service runs them: the spare `replace` relies on is held from the decision until the
job restarts on it, and a flag whose write failed for real (the database refused it, or its
connection was killed) is written on a later pass, once. The policy's choices:
tests/service/stragglers/test_straggler_policy.py."""

import time

import pytest
import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.jobs.scheduler import cancel_job
from service.models import AttemptState, JobState, Node, NodeState
from service.stragglers.spares import HOLD_SECONDS
from service.stragglers.watch import Watch
from tests.service.jobs.test_scheduler import add_job, tick
from tests.service.stragglers.test_straggler_policy import sessions  # noqa: F401 (a fixture)
from tests.service.stragglers.test_straggler_policy import flags, started, steps, stop_shares, watched


def node_named(session: Session, name: str) -> Node:
    session.expire_all()
    return session.scalar(select(Node).where(Node.name == name))


def nodes_of(attempt) -> list[str]:
    return [share.node.name for share in attempt.nodes]


def passed(watch: Watch, session: Session, sessions, settings, now: float) -> list:
    """A pass of the watch, the test's transaction ended first (SQLite's would hold the write lock)."""
    session.commit()
    return watched(watch, session, sessions, settings, now)


def test_the_spare_is_held_from_the_decision_until_the_job_restarts_on_it(session, settings, sessions):
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, _ = started(session, settings, ["a", "b", "spare"], now, max_restarts=2)
    steps(session, job, 0, now, 1, 30, slow_from=11)
    passed(Watch(), session, sessions, settings, now + 40)
    [flag] = flags(session, job)
    assert flag.action == "replaced"
    spare = node_named(session, "spare")
    assert (spare.state, spare.reserved_for) == (NodeState.reserved, job.id)
    other = add_job(session, nodes=1, procs_per_node=1)  # queued while the replaced job's ranks save and stop
    tick(session, settings, now + 41)
    passed(Watch(), session, sessions, settings, now + 41)  # a pass keeps a hold whose restart is coming
    session.refresh(other)
    assert other.state == JobState.queued and node_named(session, "spare").state == NodeState.reserved
    stop_shares(session, job, now + 42)
    tick(session, settings, now + 42)  # the restart first, on its spare; the queued job on the node left out
    session.refresh(job)
    session.refresh(other)
    assert nodes_of(job.attempts[1]) == ["a", "spare"] and nodes_of(other.attempts[0]) == ["b"]
    assert node_named(session, "spare").reserved_for is None


def test_a_hold_no_restart_ends_is_ended_after_its_bound(session, settings, sessions):
    now = time.time() - 600  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, _ = started(session, settings, ["a", "b", "spare"], now, max_restarts=2)
    steps(session, job, 0, now, 1, 30, slow_from=11)
    passed(Watch(), session, sessions, settings, now + 40)  # its ranks never confirm the stop
    passed(Watch(), session, sessions, settings, now + 40 + HOLD_SECONDS - 1)
    assert node_named(session, "spare").state == NodeState.reserved
    passed(Watch(), session, sessions, settings, now + 40 + HOLD_SECONDS + 1)
    assert (node_named(session, "spare").state, node_named(session, "spare").reserved_for) == (NodeState.idle, None)


def test_a_hold_ends_with_its_job(session, settings, sessions):
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, _ = started(session, settings, ["a", "b", "spare"], now, max_restarts=2)
    steps(session, job, 0, now, 1, 30, slow_from=11)
    passed(Watch(), session, sessions, settings, now + 40)
    session.refresh(job)
    cancel_job(session, job, now + 41)
    passed(Watch(), session, sessions, settings, now + 41)
    assert node_named(session, "spare").state == NodeState.idle


def test_a_spare_locked_by_another_transaction_at_the_decision_keeps_the_job_running(
        session, settings, sessions, database_url):
    if not database_url.startswith("postgresql"):
        pytest.skip("SQLite has no row locks: its writers queue (BEGIN IMMEDIATE)")
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, _ = started(session, settings, ["a", "b", "spare"], now, max_restarts=2)
    steps(session, job, 0, now, 1, 30, slow_from=11)
    other = sa.create_engine(database_url)
    with other.connect() as conn, conn.begin():  # another service's tick giving the spare away right now
        conn.execute(sa.text("SELECT id FROM nodes WHERE name = 'spare' FOR UPDATE"))
        passed(Watch(), session, sessions, settings, now + 40)
    other.dispose()
    [flag] = flags(session, job)
    assert (flag.action, flag.reason) == ("kept", "no spare node was free")
    session.refresh(job)
    assert job.attempts[-1].state == AttemptState.running and node_named(session, "spare").state == NodeState.idle


REFUSE = {  # a real failure of the flag's write: the database refuses it, or its connection dies in it
    "sqlite": ["CREATE TRIGGER refuse_flags BEFORE INSERT ON stragglers BEGIN SELECT RAISE(ABORT, 'refused'); END"],
    "postgresql": ["CREATE FUNCTION lose_connection() RETURNS trigger LANGUAGE plpgsql AS "
                   "$$ BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NEW; END $$",
                   "CREATE TRIGGER refuse_flags BEFORE INSERT ON stragglers FOR EACH ROW "
                   "EXECUTE FUNCTION lose_connection()"],
}
ALLOW = {"sqlite": ["DROP TRIGGER refuse_flags"],
         "postgresql": ["DROP TRIGGER refuse_flags ON stragglers", "DROP FUNCTION lose_connection()"]}


def test_a_flag_whose_write_failed_is_written_on_a_later_pass_once(session, settings, sessions, database_url):
    backend = database_url.split(":")[0].split("+")[0]
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, _ = started(session, settings, ["a", "b", "spare"], now, max_restarts=2)
    steps(session, job, 0, now, 1, 30, slow_from=11)
    for statement in REFUSE[backend]:
        session.execute(sa.text(statement))
    session.commit()
    watch = Watch()
    assert [s.rank for s in passed(watch, session, sessions, settings, now + 40)] == [1]  # found, not written
    session.refresh(job)
    assert flags(session, job) == [] and job.attempts[0].state == AttemptState.running
    assert node_named(session, "spare").state == NodeState.idle  # nor the replacement's hold: undone with it
    for statement in ALLOW[backend]:
        session.execute(sa.text(statement))
    session.commit()
    assert passed(watch, session, sessions, settings, now + 41) == []  # nothing new found: the write tried again
    [flag] = flags(session, job)
    session.refresh(job)
    assert (flag.rank, flag.action) == (1, "replaced") and job.attempts[0].cause == "straggler"
    passed(watch, session, sessions, settings, now + 42)
    passed(Watch(), session, sessions, settings, now + 42)  # another service process, scoring afresh
    assert len(flags(session, job)) == 1 and len(job.attempts) == 1
