"""Two scheduler processes on one PostgreSQL never hand one node two attempts."""

import multiprocessing
import time
import uuid
from collections import Counter

import sqlalchemy as sa
from sqlalchemy import select

from service.db import make_engine, make_session_factory
from service.jobs import scheduler
from service.migrate import upgrade
from service.models import Attempt, AttemptNode, Job, JobState, Node, Role, Token
from service.schemas.agents import AttemptReport
from service.settings import Settings
from tests.service.factories import job_spec


def tick_until(url: str, stop) -> None:
    # Every node stays alive for the test: no heartbeat traffic beside the two schedulers.
    settings = Settings(database_url=url, restart_backoff_seconds=0, heartbeat_timeout_seconds=1e6)
    sessions = make_session_factory(make_engine(url))
    while not stop.is_set():
        with sessions() as session:
            scheduler.tick(session, settings)
            session.commit()
        time.sleep(0.005)


def active_shares(session):
    return session.scalars(select(AttemptNode).join(Attempt).where(Attempt.state.in_(scheduler.ACTIVE))).all()


def test_concurrent_schedulers_never_double_allocate(new_database_url):
    url = new_database_url("postgresql")
    upgrade(url)
    sessions = make_session_factory(make_engine(url))
    with sessions() as session:
        token = Token(subject="agents", role=Role.agent, token_hash=uuid.uuid4().hex)
        session.add(token)
        session.flush()
        session.add_all(Node(name=f"n{i}", address=f"10.0.0.{i}", slots=2, token_id=token.id) for i in range(7))
        session.add_all(Job(id=uuid.uuid4().hex, name=f"j{i}", owner="a", spec=job_spec()) for i in range(12))
        session.commit()

    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    workers = [spawn.Process(target=tick_until, args=(url, stop)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        for _round in range(3):
            deadline = time.monotonic() + 60
            with sessions() as session:
                while len(active_shares(session)) < 6 and time.monotonic() < deadline:
                    session.rollback()  # a new snapshot
                    time.sleep(0.05)
                time.sleep(0.3)  # both schedulers get more chances to double-allocate
                session.rollback()
                active = active_shares(session)
                per_node = Counter(share.node_id for share in active)
                assert len(active) == 6 and max(per_node.values()) == 1, per_node
                per_job = Counter(share.attempt.job_id for share in active)
                assert set(per_job.values()) == {2}  # whole gangs only
                # Finish the running jobs, freeing their nodes for the next round.
                for share in active:
                    report = AttemptReport(job_id=share.attempt.job_id, attempt=share.attempt.number,
                                           state="succeeded")
                    scheduler.on_reports(session, share.node, [report], time.time())
                session.commit()
    finally:
        stop.set()
        for worker in workers:
            worker.join(30)
    assert [w.exitcode for w in workers] == [0, 0]
    with sessions() as session:
        finished = session.scalar(select(sa.func.count()).where(Job.state == JobState.succeeded))
        assert finished == 9  # 3 gangs of 2 on 7 nodes, 3 rounds
