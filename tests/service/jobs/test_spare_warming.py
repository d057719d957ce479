"""While a job runs, the idle nodes that could take its next attempt (spares) are told to warm the
server that attempt would fork from there (issue #49, item 4): its owner, its warm imports, named or
learned; the trainer's server for a trainer job; nothing for a job with `env`."""

from sqlalchemy import event
from sqlalchemy.orm import Session

from service.db import make_session_factory
from service.jobs.launch import warm_spares
from service.jobs.scheduler import fail_attempt
from service.models import Node
from service.settings import Settings
from tests.service.jobs.test_scheduler import T0, add_job, add_nodes, report, taken, tick

LEARNED = ["idna.core", "torch.nn.parallel.distributed"]


def warms(session, node: Node) -> list[dict]:
    return [c for c in taken(session, node) if c["type"] == "warm"]


def test_the_first_spares_by_name_warm_a_scripts_server_and_then_what_it_learned(session, settings):
    a, b, e, c, d = add_nodes(session, "a", "b", "e-spare", "c-spare", "d-spare")
    job = add_job(session, entrypoint=["python", "train.py"], procs_per_node=1)
    tick(session, settings, T0)
    assert warms(session, a) == warms(session, b) == []  # they run it: launches, no warm command
    # As many spares as the job has nodes, the ones a restart would take first (service/jobs/placement.py).
    [told_c], [told_d], not_e = warms(session, c), warms(session, d), warms(session, e)
    assert told_c == told_d and not_e == []
    assert told_c["job_id"] == job.id and told_c["owner"] == "alice" and told_c["owner_number"] >= 1
    assert told_c["entrypoint"] == ["python", "train.py"] and told_c["warm_imports"] == []  # nothing learned yet
    report(session, a, job, 0, "failed", T0 + 1, imports=LEARNED, cause="signal")
    report(session, b, job, 0, "stopped", T0 + 1)
    tick(session, settings, T0 + settings.restart_backoff_seconds + 2)
    assert [w["warm_imports"] for w in warms(session, c) + warms(session, d)] == [LEARNED, LEARNED]


def test_a_trainer_job_warms_its_owners_trainer_server_and_a_job_with_env_nothing(session, settings):
    a, b, spare = add_nodes(session, "a", "b", "spare")
    trainer = add_job(session, nodes=1)
    tick(session, settings, T0)
    [told] = warms(session, b) + warms(session, spare)  # one spare for a 1-node job, the first by name
    assert told["job_id"] == trainer.id and told["entrypoint"] is None and told["warm_imports"] == []
    add_job(session, nodes=1, entrypoint=["python", "train.py"], procs_per_node=1, env={"X": "1"})
    tick(session, settings, T0 + 1)
    assert warms(session, b) == []  # it runs the job with env, whose spare is told nothing
    # The trainer job's first spare now that b is taken, told at that pass.
    assert [w["job_id"] for w in warms(session, spare)] == [trainer.id]


def test_no_node_that_could_not_take_the_attempt_is_told(session, settings):
    a, b = add_nodes(session, "a", "b")
    (small,) = add_nodes(session, "small", slots=1)
    drained, fenced, unhealthy = add_nodes(session, "drained", "fenced", "unhealthy")
    drained.drained, fenced.fenced, unhealthy.health = "by an admin", "lost for a job", "disk full"
    session.commit()
    add_job(session, entrypoint=["python", "train.py"], procs_per_node=2)
    tick(session, settings, T0)
    assert [warms(session, n) for n in (small, drained, fenced, unhealthy)] == [[], [], [], []]


def test_a_node_idle_after_the_attempt_started_is_told_once(session, settings):
    """A node that registers (or is freed) once the attempt runs was not there to be told at its
    start: the next pass tells it, and no later pass tells it again."""
    a, b = add_nodes(session, "a", "b")
    job = add_job(session, entrypoint=["python", "train.py"], procs_per_node=1)
    tick(session, settings, T0)
    (late,) = add_nodes(session, "late")
    tick(session, settings, T0 + 1)
    [told] = warms(session, late)
    assert told["job_id"] == job.id and told["warm_imports"] == []
    tick(session, settings, T0 + 2)
    assert warms(session, late) == []


def test_what_the_first_attempt_learned_reaches_its_spares_while_it_runs(session, settings):
    """A script that names no `warm_imports`: its spares warm the base server at its start, and what
    its first attempt imported as soon as a running report carries it, in that same attempt (a node
    loss in it then restarts on a spare that warms what the script loads), once."""
    a, b, spare = add_nodes(session, "a", "b", "spare")
    job = add_job(session, entrypoint=["python", "train.py"], procs_per_node=1, nodes=2)
    tick(session, settings, T0)
    assert [w["warm_imports"] for w in warms(session, spare)] == [[]]
    report(session, a, job, 0, "running", T0 + 1)
    report(session, a, job, 0, "running", T0 + 2, imports=LEARNED)
    tick(session, settings, T0 + 3)
    assert [w["warm_imports"] for w in warms(session, spare)] == [LEARNED]
    assert [(attempt.number, attempt.state.value) for attempt in job.attempts] == [(0, "running")]
    report(session, b, job, 0, "running", T0 + 4, imports=LEARNED)  # the other node's list: the first is kept
    tick(session, settings, T0 + 5)
    assert warms(session, spare) == []


def test_a_straggler_left_out_and_an_attempts_own_idle_node_are_not_told(session, settings):
    """The rules a pass applies to the idle nodes it read once are free_spare_nodes' (service/jobs/placement.py):
    not the node the job left out for a straggler, not a node of the attempt itself (its share ended)."""
    a, b, c, d, e = add_nodes(session, "a", "b", "c", "d", "e")
    job = add_job(session, entrypoint=["python", "train.py"], procs_per_node=1, nodes=2)
    tick(session, settings, T0)
    assert [len(warms(session, n)) for n in (c, d, e)] == [1, 1, 0]
    fail_attempt(session, job.attempts[0], "straggler", "rank 1 on b straggles", T0 + 1, node=b)
    session.commit()
    report(session, a, job, 0, "stopped", T0 + 1)
    report(session, b, job, 0, "stopped", T0 + 1)
    tick(session, settings, T0 + settings.restart_backoff_seconds + 2)
    assert [n.node.name for n in job.attempts[1].nodes] == ["a", "c"]  # b left out
    assert warms(session, b) == [] and [w["job_id"] for w in warms(session, e)] == [job.id]  # d, e: b left out
    report(session, a, job, 1, "succeeded", T0 + 4)  # a idle again, its attempt still running on c
    tick(session, settings, T0 + 5)
    assert [warms(session, n) for n in (a, b)] == [[], []]


def queries_of_a_pass(session: Session, settings: Settings, now: float) -> list[str]:
    """The statements one warm_spares pass sends, in a session of its own as each tick has (nothing
    loaded), its transaction begun first (SQLite's BEGIN IMMEDIATE is no query of the pass)."""
    engine, statements = session.get_bind(), []

    def record(_conn, _cursor, statement, *_) -> None:
        statements.append(statement)

    with make_session_factory(engine)() as fresh:
        fresh.connection()
        event.listen(engine, "before_cursor_execute", record)
        try:
            warm_spares(fresh, settings, now)
            fresh.flush()
        finally:
            event.remove(engine, "before_cursor_execute", record)
    return statements


def test_a_pass_makes_as_many_queries_for_fifty_running_jobs_as_for_one(session, settings):
    """The scheduler's path: a few queries a pass whatever the number of running attempts, not
    several for each; and only the idle nodes' one where none is idle (a busy cluster's usual pass)."""
    add_nodes(session, "busy-00", "spare-1", "spare-2")
    add_job(session, entrypoint=["python", "train.py"], procs_per_node=1, nodes=1)
    tick(session, settings, T0)
    one = queries_of_a_pass(session, settings, T0 + 1)
    add_nodes(session, *(f"busy-{i:02}" for i in range(1, 50)))
    for _ in range(49):
        add_job(session, entrypoint=["python", "train.py"], procs_per_node=1, nodes=1)
    tick(session, settings, T0 + 2)
    fifty = queries_of_a_pass(session, settings, T0 + 3)
    assert len(fifty) == len(one) <= 6, fifty
    add_job(session, entrypoint=["python", "train.py"], procs_per_node=1, nodes=2)
    tick(session, settings, T0 + 4)  # the two spares taken
    assert len(queries_of_a_pass(session, settings, T0 + 5)) == 1
