"""Elastic jobs (spec `elastic`, service/jobs/elastic.py) on both databases, driven tick by tick: the
spec's bounds, the size a restart takes when nodes are gone and no spare is free, and growing back
when nodes return, weighed by the straggler policy's cost model. The events a run writes (its
`elastic` declaration, its steps and timing windows) go through the service's own ingestion."""

import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from ett.events import make_event
from ett.protocol.messages import command_adapter
from service.ingest.store import ingest_trusted
from service.jobs import scheduler
from service.jobs.elastic import elastic_size
from service.models import AttemptState, Job, JobEvent, JobState, Node, NodeState, RankLog, utcnow
from service.stragglers.watch import Watch
from tests.service.factories import job_spec
from tests.service.jobs.test_scheduler import add_job, add_nodes, report, taken, tick
from tests.service.stragglers.test_straggler_policy import flags, sessions, started, stop_shares, watched  # noqa: F401 (a fixture)
from tests.service.stragglers.test_straggler_policy import steps as timed_steps

# A 2-node job of 2 ranks a node (factories.job_spec), with restarts to spare: growing back never
# spends a job's last restart (service/accounting/restart_cost.py).
ELASTIC = {"elastic": {"min_nodes": 1}, "max_restarts": 5}


def declare(session: Session, job: Job, attempt: int, world_sizes: list[int], now: float, full: int = 4) -> None:
    """Rank 0's `elastic` event, as ett's run.elastic writes it."""
    data = {"world_sizes": world_sizes, "full_world_size": full}
    event = make_event("elastic", now, attempt, "rank:0", 1, None, data)
    ingest_trusted(session, job.id, [event])
    session.commit()


def steps(session: Session, job: Job, attempt: int, start: float, last: int, total: int | None) -> None:
    """Rank 0's steps 1..last of one second each and the ranks' windows of five, as a run writes them."""
    events = []
    for step in range(1, last + 1):
        events.append(make_event("step", start + step, attempt, "rank:0", 100 + step, step, {"duration": 1.0}))
        if step % 5 == 0:
            window = {"steps": 5, "duration": 1.0, "work": 0.5, "work_low": 0.5}
            window |= {"total_steps": total} if total else {}
            events += [make_event("step_timing", start + step, attempt, f"rank:{rank}", 10_000 + step, step, window)
                       for rank in (0, 1)]  # fmt: skip
    ingest_trusted(session, job.id, events)
    session.commit()


def lose(session: Session, settings, node: Node, now: float) -> None:
    """The node's heartbeats stop: the next tick declares it lost (the tick() helper leaves it so)."""
    node.last_heartbeat_at = utcnow().replace(year=2000)
    session.commit()
    scheduler.tick(session, settings, now)
    session.commit()


def running_on_a_and_b(session: Session, settings, spec: dict, now: float, prefix: str = "") -> tuple[Job, Node, Node]:
    a, b = add_nodes(session, f"{prefix}a", f"{prefix}b")
    job = add_job(session, **spec)
    tick(session, settings, now)
    for node in (a, b):
        taken(session, node)
        report(session, node, job, 0, "running", now + 1)
    return job, a, b


def shrunk_after_losing_b(session: Session, settings, now: float) -> tuple[Job, Node, Node]:
    """A declared elastic job that lost node b with no spare: its next attempt runs on a alone."""
    job, a, b = running_on_a_and_b(session, settings, ELASTIC, now)
    declare(session, job, 0, [2], now + 2)
    lose(session, settings, b, now + 10)
    report(session, a, job, 0, "stopped", now + 11)
    tick(session, settings, now + 12)
    session.refresh(job)
    return job, a, b


def test_the_spec_refuses_min_nodes_above_nodes_below_1_and_with_slurm(service):
    client = service.client(service.token("user"))
    for elastic, field in [({"min_nodes": 3}, "elastic.min_nodes"), ({"min_nodes": 0}, "elastic.min_nodes"),
                           ({"min_nodes": "1"}, "elastic.min_nodes"), ({"min_nodes": 1, "extra": 1}, "elastic.extra")]:
        response = client.post("/api/v1/jobs", json=job_spec(elastic=elastic))
        assert response.status_code == 422, response.text
        assert [e["field"] for e in response.json()["detail"]] == [field], response.text
    response = client.post("/api/v1/jobs", json=job_spec(elastic={"min_nodes": 1}, slurm={}))
    assert response.status_code == 422 and "elastic" in response.text
    accepted = client.post("/api/v1/jobs", json=job_spec(elastic={"min_nodes": 2}))
    assert accepted.status_code == 201 and accepted.json()["spec"]["elastic"] == {"min_nodes": 2}


def test_min_nodes_equal_to_nodes_behaves_as_a_job_that_is_not_elastic(session, settings):
    """The same loss with no spare, the same declaration: both wait for a node, alike."""
    now = time.time() - 300  # the ticks below run within the nodes' heartbeats (stamped at the real time)
    seen = []
    for prefix, spec in (("plain-", {}), ("same-", {"elastic": {"min_nodes": 2}})):
        job, a, b = running_on_a_and_b(session, settings, spec, now, prefix)
        declare(session, job, 0, [2], now + 2)
        lose(session, settings, b, now + 10)
        report(session, a, job, 0, "stopped", now + 11)
        tick(session, settings, now + 12)
        session.refresh(job)
        seen.append((len(job.attempts), job.state, job.reason, a.state, job.attempts[0].full_nodes))
        scheduler.cancel_job(session, job, now + 13)  # out of the next round's way, its node too
        a.drained = "kept out of the next round"
        session.commit()
    assert seen == [(1, JobState.running, None, NodeState.idle, None)] * 2


def test_no_shrink_while_its_own_nodes_are_still_stopping(session, settings):
    """A killed rank, every node healthy: node a (node rank 0, whose end may bring the newest commit) still
    stops its share (killed at once), so the job waits for it and restarts on both nodes, though it
    declared a smaller size and only b is idle meanwhile."""
    now = time.time() - 300  # the ticks below run within the nodes' heartbeats (stamped at the real time)
    job, a, b = running_on_a_and_b(session, settings, ELASTIC, now)
    declare(session, job, 0, [2], now + 2)
    report(session, b, job, 0, "failed", now + 5, cause="signal", detail="rank 3 killed by SIGKILL")
    assert b.state == NodeState.idle and a.state == NodeState.busy
    session.refresh(job)
    assert elastic_size(session, job, [b], set()) == (None, "")  # a comes back: no smaller attempt
    tick(session, settings, now + 5 + settings.restart_backoff_seconds + 0.5)  # no checkpoint yet: its backoff
    session.refresh(job)
    assert len(job.attempts) == 1  # not on b alone
    report(session, a, job, 0, "failed", now + 6, cause="exit", detail="rank 1 exit code 1", exit_code=1)
    tick(session, settings, now + 6 + settings.restart_backoff_seconds + 0.5)
    session.refresh(job)
    assert [s.node.name for s in job.attempts[1].nodes] == ["a", "b"] and job.attempts[1].full_nodes is None
    launches = [c for node in (a, b) for c in taken(session, node) if c["type"] == "launch"]
    assert [(c["nnodes"], c["full_nnodes"]) for c in launches] == [(2, None), (2, None)]


def test_a_lost_node_with_no_spare_restarts_it_at_once_on_the_size_its_run_declared(session, settings):
    now = time.time() - 300  # the ticks below run within the nodes' heartbeats (stamped at the real time)
    job, a, b = shrunk_after_losing_b(session, settings, now)
    attempt = job.attempts[1]
    assert [s.node.name for s in attempt.nodes] == ["a"] and attempt.full_nodes == 2
    assert job.reason.startswith("running on 1 of 2 nodes (elastic)")
    [launch] = [c for c in taken(session, a) if c["type"] == "launch"]
    assert (launch["nnodes"], launch["full_nnodes"], launch["node_rank"]) == (1, 2, 0)
    command_adapter.validate_python(launch)  # what the agent reads
    allocated = session.scalar(select(JobEvent.data).where(JobEvent.job_id == job.id, JobEvent.attempt == 1,
                                                           JobEvent.kind == "attempt_allocated"))
    assert allocated == {"nodes": ["a"], "full_nodes": 2}


def test_a_run_that_never_declared_waits_for_its_full_size_and_says_what_to_do(session, settings):
    now = time.time() - 300  # the ticks below run within the nodes' heartbeats (stamped at the real time)
    job, a, b = running_on_a_and_b(session, settings, ELASTIC, now)
    lose(session, settings, b, now + 10)
    report(session, a, job, 0, "stopped", now + 11)
    tick(session, settings, now + 12)
    session.refresh(job)
    assert len(job.attempts) == 1 and a.state == NodeState.idle
    assert "never declared" in job.reason and "run.elastic(global_batch, micro_batch)" in job.reason
    declare(session, job, 0, [3], now + 13)  # not a whole number of nodes: still none it can take
    tick(session, settings, now + 14)
    session.refresh(job)
    assert len(job.attempts) == 1 and "its run declared no size below its full one" in job.reason


def test_it_grows_back_when_a_node_returns_and_that_pays(session, settings):
    now = time.time() - 300  # the ticks below run within the nodes' heartbeats (stamped at the real time)
    job, a, b = shrunk_after_losing_b(session, settings, now)
    report(session, a, job, 1, "running", now + 13)
    steps(session, job, 1, now + 14, 20, total=10_000)
    tick(session, settings, now + 40)
    assert job.attempts[1].state == AttemptState.running, job.attempts[1].detail  # no node free: nothing to weigh
    (c,) = add_nodes(session, "c")
    tick(session, settings, now + 41)
    session.refresh(job)
    attempt = job.attempts[1]
    assert attempt.state == AttemptState.failed and attempt.cause == "grow"
    assert attempt.detail.startswith("growing back to 2 of 2 nodes at a checkpoint: it saves")
    assert [(c["type"], c["attempt"]) for c in taken(session, a)] == [("stop", 0), ("launch", 1), ("stop", 1)]
    report(session, a, job, 1, "stopped", now + 43)
    tick(session, settings, now + 44)
    session.refresh(job)
    assert [s.node.name for s in job.attempts[2].nodes] == ["a", "c"] and job.attempts[2].full_nodes is None
    [launch] = [command for command in taken(session, c) if command["type"] == "launch"]
    assert job.reason is None and (launch["nnodes"], launch["full_nnodes"]) == (2, None)


def test_it_does_not_grow_when_that_does_not_pay_nor_weigh_the_same_nodes_twice(session, settings):
    now = time.time() - 300  # the ticks below run within the nodes' heartbeats (stamped at the real time)
    job, a, b = shrunk_after_losing_b(session, settings, now)
    report(session, a, job, 1, "running", now + 13)
    steps(session, job, 1, now + 14, 20, total=22)  # two steps left: a restart costs more
    add_nodes(session, "c")
    tick(session, settings, now + 41)
    session.refresh(job)
    assert job.attempts[1].state == AttemptState.running
    assert job.reason.startswith("not growing back to 2 of 2 nodes: it would save 1.0 s over its 2 remaining steps")
    job.reason = "said once"
    session.commit()
    tick(session, settings, now + 42)
    assert job.reason == "said once" and job.attempts[1].grow_weighed == 2


def test_it_does_not_grow_when_its_remaining_steps_are_unknown(session, settings):
    now = time.time() - 300  # the ticks below run within the nodes' heartbeats (stamped at the real time)
    job, a, b = shrunk_after_losing_b(session, settings, now)
    report(session, a, job, 1, "running", now + 13)
    add_nodes(session, "c")
    tick(session, settings, now + 14)
    session.refresh(job)
    assert job.reason == "growing back to 2 of 2 nodes waits for the attempt's first step times"
    steps(session, job, 1, now + 14, 20, total=None)
    tick(session, settings, now + 40)
    session.refresh(job)
    assert job.attempts[1].state == AttemptState.running and "remaining steps are unknown" in job.reason


@pytest.mark.parametrize("declared", [True, False])
def test_a_stragglers_node_with_no_spare_is_left_out_where_the_run_declared_a_smaller_size(session, settings, sessions,
                                                                                         declared):
    """`stragglers = "replace"` with no spare free: an elastic job whose run declared 1 node goes on
    without the slow node, its slowdown (8x) costing more than the restart and the steps at half
    size; one that never declared keeps it, as a job that is not elastic."""
    now = time.time() - 300  # the passes below run within the nodes' heartbeats (stamped at the real time)
    job, (a, b) = started(session, settings, ["a", "b"], now, max_restarts=3, elastic={"min_nodes": 1})
    if declared:
        declare(session, job, 0, [1], now + 1, full=2)
    timed_steps(session, job, 0, now, 1, 30, slow_from=11, factor=8.0)
    watched(Watch(), session, sessions, settings, now + 40)
    [flag] = flags(session, job)
    if not declared:
        assert flag.action == "kept" and "no spare node was free" in flag.reason
        return
    assert (flag.node, flag.action, flag.reason) == ("b", "replaced", None)
    stop_shares(session, job, now + 41)
    tick(session, settings, now + 42)
    session.refresh(job)
    assert [n.node.name for n in job.attempts[1].nodes] == ["a"] and job.attempts[1].full_nodes == 2


def test_no_shrink_on_a_suspicion_a_node_its_peers_lost_is_waited_for_through_its_silence_window(session, settings):
    """Node a's ranks lose their connection to b, which says nothing since: with no spare, the elastic job does
    not shrink to a alone after the short grace (b may be only late), only once b's silence window is over."""
    now = time.time() - 300  # the ticks below run within the nodes' heartbeats (stamped at the real time)
    job, a, b = running_on_a_and_b(session, settings, ELASTIC, now)
    declare(session, job, 0, [2], now + 2)
    gloo = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:15024"
    session.add(RankLog(job_id=job.id, attempt=0, rank=0, node="a", text=f"step 7\n{gloo}\n"))
    b.last_heartbeat_at = datetime.fromtimestamp(now + 1, UTC)
    report(session, a, job, 0, "failed", now + 5, cause="exit", detail="rank 0 exit code 1", exit_code=1)
    assert job.attempts[0].diagnosis == "peer_lost"
    scheduler.tick(session, settings, now + 5 + settings.peer_loss_grace_seconds)
    session.commit()
    assert len(job.attempts) == 1 and b.state == NodeState.busy
    scheduler.tick(session, settings, now + 5 + settings.peer_loss_silence_seconds)
    session.commit()
    session.refresh(job)
    assert b.state == NodeState.lost and [s.node.name for s in job.attempts[1].nodes] == ["a"]
