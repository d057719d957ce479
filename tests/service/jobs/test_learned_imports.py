"""What a job's script imported in its first attempt (AttemptReport.imports) becomes its next
launches' warm imports on every node, the spare that replaces a lost node included (issue #49)."""

import time

from sqlalchemy import select

from service.jobs import scheduler
from service.models import Job, NodeState, utcnow
from tests.service.jobs.test_scheduler import T0, add_job, add_nodes, report, taken, tick

LEARNED = ["idna.core", "torch.nn.parallel.distributed", "transformers.trainer"]


def launches(session, node) -> list[dict]:
    return [c for c in taken(session, node) if c["type"] == "launch"]


def test_the_imports_a_node_reports_reach_the_next_launch_on_every_node_the_spare_included(session, settings):
    a, b, spare = add_nodes(session, "a", "b", "c-spare")
    job = add_job(session, entrypoint=["python", "train.py"], procs_per_node=1)
    tick(session, settings, T0)
    assert [c["warm_imports"] for c in launches(session, a) + launches(session, b)] == [[], []]
    report(session, a, job, 0, "running", T0 + 1, imports=LEARNED)  # as soon as its local rank 0 wrote them
    b.last_heartbeat_at = utcnow().replace(year=2000)  # b goes silent: lost, its share with it
    session.commit()
    scheduler.tick(session, settings, time.time())
    session.commit()
    assert b.state == NodeState.lost
    report(session, a, job, 0, "stopped", time.time())  # node rank 0's end is waited for (restarts.handed_over)
    tick(session, settings, time.time() + settings.restart_backoff_seconds + 1)
    session.refresh(job)
    assert [s.node.name for s in job.attempts[1].nodes] == ["a", "c-spare"]
    assert [c["warm_imports"] for c in launches(session, a) + launches(session, spare)] == [LEARNED, LEARNED]
    assert session.scalar(select(Job.learned_imports).where(Job.id == job.id)) == LEARNED


def test_the_first_list_stays(session, settings):
    a, b = add_nodes(session, "a", "b")
    job = add_job(session, entrypoint=["python", "train.py"], procs_per_node=1)
    tick(session, settings, T0)
    report(session, a, job, 0, "failed", T0 + 1, imports=LEARNED, cause="signal")
    report(session, b, job, 0, "stopped", T0 + 1, imports=["idna"])  # a later list replaces nothing
    tick(session, settings, T0 + settings.restart_backoff_seconds + 2)
    session.refresh(job)
    assert len(job.attempts) == 2 and job.learned_imports == LEARNED
    report(session, a, job, 1, "failed", T0 + 20, imports=["idna"], cause="signal")
    session.refresh(job)
    assert job.learned_imports == LEARNED


def test_a_job_that_names_its_imports_keeps_them(session, settings):
    a, b = add_nodes(session, "a", "b")
    job = add_job(session, entrypoint=["python", "train.py"], procs_per_node=1, warm_imports=["torch.nn"])
    tick(session, settings, T0)
    report(session, a, job, 0, "failed", T0 + 1, imports=LEARNED, cause="signal")
    report(session, b, job, 0, "stopped", T0 + 1)
    tick(session, settings, T0 + settings.restart_backoff_seconds + 2)
    session.refresh(job)
    assert len(job.attempts) == 2 and job.learned_imports is None
    assert [c["warm_imports"] for c in launches(session, a)] == [["torch.nn"], ["torch.nn"]]


def test_a_list_stored_before_a_name_was_refused_reaches_no_launch_and_no_warm_command(session, settings):
    """`jobs.learned_imports` written by a service that did not yet refuse modules that act when
    imported (ett.protocol.acts_at_import) or odd names: the next launches and the spares' warm
    commands carry the others only, and the scheduler's passes go on."""
    a, b, spare = add_nodes(session, "a", "b", "c-spare")
    job = add_job(session, entrypoint=["python", "train.py"], procs_per_node=1)
    tick(session, settings, T0)
    job.learned_imports = ["idna.core", "antigravity", "unittest.__main__", "os; import this", "torch.nn"]
    session.commit()
    report(session, a, job, 0, "failed", T0 + 1, cause="signal")
    report(session, b, job, 0, "stopped", T0 + 1)
    tick(session, settings, T0 + settings.restart_backoff_seconds + 2)
    session.refresh(job)
    assert len(job.attempts) == 2
    assert [c["warm_imports"] for c in launches(session, a)] == [[], ["idna.core", "torch.nn"]]
    warmed = [c["warm_imports"] for c in taken(session, spare) if c["type"] == "warm"]
    assert warmed and all(names in ([], ["idna.core", "torch.nn"]) for names in warmed), warmed
