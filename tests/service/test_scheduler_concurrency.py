"""Two scheduler processes on one PostgreSQL never hand one node two attempts."""

import multiprocessing
import time
import uuid
from collections import Counter

import sqlalchemy as sa
from sqlalchemy import select

from service import scheduler
from service.db import make_engine, make_session_factory
from service.migrate import upgrade
from service.models import Attempt, AttemptNode, AttemptState, Job, JobState, Node, Role, Token, utcnow
from service.settings import Settings
from tests.service.factories import job_spec


def tick_for(url: str, seconds: float) -> None:
    settings = Settings(database_url=url, restart_backoff_seconds=0)
    sessions = make_session_factory(make_engine(url))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with sessions() as session:
            session.execute(sa.update(Node).values(last_heartbeat_at=utcnow()))
            scheduler.tick(session, settings)
            session.commit()


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
    for _round in range(3):
        workers = [spawn.Process(target=tick_for, args=(url, 2.0)) for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
            assert worker.exitcode == 0
        with sessions() as session:
            active = session.scalars(
                select(AttemptNode).join(Attempt).where(Attempt.state.in_(scheduler.ACTIVE))
            ).all()
            per_node = Counter(share.node_id for share in active)
            assert active and max(per_node.values()) == 1, per_node
            per_job = Counter(share.attempt.job_id for share in active)
            assert set(per_job.values()) == {2}  # whole gangs only
            # Finish the running jobs, freeing their nodes for the next round.
            for share in active:
                scheduler.on_reports(session, share.node, [
                    scheduler.AttemptReport(job_id=share.attempt.job_id, attempt=share.attempt.number,
                                            state="succeeded")], time.time())
            session.commit()
    with sessions() as session:
        finished = session.scalar(select(sa.func.count()).where(Job.state == JobState.succeeded))
        assert finished == 9  # 3 gangs of 2 on 7 nodes, 3 rounds
        assert session.scalar(select(sa.func.count()).where(Attempt.state == AttemptState.allocated)) == 0
