"""Gang scheduling and restart decisions.

Every function here works inside the caller's transaction, which the caller commits. Allocation
locks the job and the nodes it takes (FOR UPDATE SKIP LOCKED on PostgreSQL), so several service
processes never hand one node two attempts; SQLite has a single writer and one process.
"""

import time
from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, contains_eager, selectinload

from ett.protocol.event_fields import AttemptFailedData, AttemptStoppedData, JobFinishedData
from ett.protocol.messages import AttemptReport, StopCommand
from service.agents import commands, node_evidence
from service.agents.nodes import fleet_capacity, waiting_reason
from service.jobs.checkpoints import newest_checkpoint
from service.failures.diagnosis import (Diagnosis, FailurePolicy, diagnose, no_restart_reason, reported_failure,
                                    without_logs)
from service.jobs.elastic import elastic_size, weigh_growing
from service.jobs.intervals import retune_auto_intervals
from service.jobs.launch import learn_imports, start_attempt, warm_spares
from service.jobs.peer_loss import PEER_LOST, fence, lost_to_their_peers, next_due
from service.jobs.placement import assignable, may_take, rank_order, served_job, straggler_avoided
from service.jobs.restarts import handed_over_nodes, needs_attempt
from service.jobs.service_events import emit
from service.models import ACTIVE_ATTEMPT_STATES as ACTIVE
from service.models import BROKEN_CAUSES, Attempt, AttemptNode, AttemptState, Job, JobEvent, JobState, Node, NodeState
from service.models import SlurmState, utc_at
from service.settings import Settings



def on_reports(session: Session, node: Node, reports: Sequence[AttemptReport], now: float) -> None:
    """Applies the attempt states an agent reports for its share of each attempt."""
    for report in reports:
        share = session.scalar(
            select(AttemptNode).join(Attempt).options(contains_eager(AttemptNode.attempt))  # one query, not two
            .where(Attempt.job_id == report.job_id, Attempt.number == report.attempt, AttemptNode.node_id == node.id)
        )  # fmt: skip
        if share is not None:
            apply_report(session, node, share, report, now)


def report_changes_nothing(share_state: AttemptState, attempt_state: AttemptState, reported: str) -> bool:
    """True when apply_report would leave everything as it is: the share has ended, or the node
    repeats that its share of a running attempt runs (what a busy node says in every heartbeat)."""
    if share_state not in ACTIVE:
        return True
    return reported == share_state == AttemptState.running and attempt_state != AttemptState.allocated


def apply_report(session: Session, node: Node, share: AttemptNode, report: AttemptReport, now: float,
                 policy: FailurePolicy = FailurePolicy(), diagnosis: Diagnosis | None = None) -> None:
    """Applies one report to the node's share of the attempt it names (loaded with its attempt; the
    heartbeats' batches load theirs at once). A failure is diagnosed from its rank's output, unless
    `diagnosis` was made before the transaction, with `policy`'s patterns (service/failures/diagnosis.py);
    it never counts against the node: what the job printed and how it ended are the job's
    (service/agents/node_evidence.py)."""
    if share.state not in ACTIVE:
        return
    if report.imports:  # before the failure below, which may already start the next attempt
        learn_imports(share.attempt.job, report.imports)
    share.state = AttemptState(report.state)
    attempt = share.attempt
    if share.state == AttemptState.running and attempt.state == AttemptState.allocated:
        attempt.state = AttemptState.running
    elif share.state == AttemptState.failed:
        cause, detail = reported_failure(report, node.name)
        diagnosis = diagnosis or diagnose(session, attempt, cause, detail, report.exit_code, policy.patterns)
        fail_attempt(session, attempt, cause, detail, now, report.exit_code, diagnosis, node)
    elif share.state == AttemptState.stopped and attempt.state in ACTIVE:
        # The agent stopped it without being told to (an agent restart): the attempt is lost.
        fail_attempt(session, attempt, "exit", f"stopped by the agent on {node.name}", now)
    elif share.state == AttemptState.succeeded and _every_share_succeeded(session, attempt):
        attempt.state, attempt.ended_at = AttemptState.succeeded, utc_at(now)
        finish_job(session, attempt.job, JobState.succeeded, None, now)
    if share.state not in ACTIVE:
        _release(session, share.node)


def _every_share_succeeded(session: Session, attempt: Attempt) -> bool:
    """Whether the attempt, still active, has every share succeeded, as committed: this share's state
    is written and the attempt locked first, so of two nodes' last successes applied at once by two
    service processes the second waits for the first and reads both (each saw the other running)."""
    session.flush()
    locked_state = session.scalar(select(Attempt.state).where(Attempt.id == attempt.id).with_for_update())
    states = session.scalars(select(AttemptNode.state).where(AttemptNode.attempt_id == attempt.id)).all()
    return locked_state in ACTIVE and all(state == AttemptState.succeeded for state in states)


def _release(session: Session, node: Node) -> None:
    """Idle once none of its shares is active: the next attempt of a broken one may hold it already
    (service/jobs/restarts.py, `hands_over`)."""
    if node.state != NodeState.busy:
        return
    session.flush()  # the share's end, written before it is asked
    active = select(AttemptNode.id).where(AttemptNode.node_id == node.id, AttemptNode.state.in_(ACTIVE)).limit(1)
    if session.scalar(active) is None:
        node.state = NodeState.idle


def fail_attempt(
    session: Session, attempt: Attempt, cause: str, detail: str, now: float, exit_code: int | None = None,
    diagnosis: Diagnosis | None = None, node: Node | None = None,
) -> None:
    """Ends an attempt as failed, stops its other nodes, and fails the job if it may not restart:
    its budget spent, a failure no restart fixes, or the same failure again and again."""
    diagnosis = diagnosis or without_logs(cause, detail, exit_code)
    data = AttemptFailedData(cause=cause, detail=detail, diagnosis=diagnosis.kind, summary=diagnosis.summary)
    if attempt.state == AttemptState.failed and _names_the_root_cause(cause, attempt.cause, diagnosis, attempt):
        # A killed rank's peers see their collectives break and exit too; whichever node reports
        # first ends the attempt, and the root cause corrects the record when it arrives.
        attempt.cause, attempt.detail = cause, detail
        attempt.diagnosis, attempt.summary = diagnosis.kind, diagnosis.summary
        attempt.failed_node_id = node.id if node is not None else None
        first_report = session.scalar(select(func.min(JobEvent.ts)).where(
            JobEvent.job_id == attempt.job_id, JobEvent.attempt == attempt.number, JobEvent.kind == "attempt_failed"))
        emit(session, attempt.job_id, attempt.number, "attempt_failed", first_report, data)
    if attempt.state not in ACTIVE:
        return
    attempt.state, attempt.cause, attempt.detail, attempt.ended_at = AttemptState.failed, cause, detail, utc_at(now)
    attempt.diagnosis, attempt.summary = diagnosis.kind, diagnosis.summary
    attempt.failed_node_id = node.id if node is not None else None
    emit(session, attempt.job_id, attempt.number, "attempt_failed", now, data)
    _stop_shares(session, attempt, "attempt failed", at_once=cause in BROKEN_CAUSES)
    job = attempt.job
    if job.state != JobState.running:
        return
    refusal = no_restart_reason(job, diagnosis, detail, exit_code, newest_checkpoint(session, job.id))
    if refusal is not None:
        finish_job(session, job, JobState.failed, refusal, now)


def _names_the_root_cause(cause: str, recorded: str | None, diagnosis: Diagnosis, attempt: Attempt) -> bool:
    """A signal, a hang or a lost node (known once its heartbeats are overdue, or its peers saw it go)
    explains a peer's plain exit; so does any failure of its own told after a survivor's lost connection."""
    if attempt.diagnosis == PEER_LOST and cause == "exit" and diagnosis.kind not in (PEER_LOST, "unknown"):
        return True
    return recorded == "exit" and cause in ("signal", "hang", "node_lost")


def _stop_shares(session: Session, attempt: Attempt, reason: str, at_once: bool = False) -> None:
    for share in attempt.nodes:
        if share.state in ACTIVE:
            stop = StopCommand(type="stop", job_id=attempt.job_id, attempt=attempt.number, reason=reason,
                               at_once=at_once)
            commands.enqueue(session, share.node, stop)


def finish_job(session: Session, job: Job, state: JobState, reason: str | None, now: float) -> None:
    job.state, job.reason, job.finished_at = state, reason[:512] if reason else reason, utc_at(now)
    if job.attempts:  # a job never allocated has no window, so no job_finished event
        emit(session, job.id, job.attempts[-1].number, "job_finished", now, JobFinishedData(state=state.value))


def cancel_job(session: Session, job: Job, now: float) -> None:
    if job.state not in (JobState.queued, JobState.running):
        return
    for attempt in job.attempts:
        if attempt.state in ACTIVE:
            attempt.state, attempt.ended_at = AttemptState.stopped, utc_at(now)
            emit(session, job.id, attempt.number, "attempt_stopped", now, AttemptStoppedData(reason="cancelled"))
            _stop_shares(session, attempt, "cancelled")
    finish_job(session, job, JobState.cancelled, "cancelled", now)


def tick(session: Session, settings: Settings, now: float | None = None, up_since: float | None = None) -> float | None:
    """One pass: decide, then tend. Returns when a decision falls due before the next period (a lost
    node's grace or window ends), for the caller to tick then."""
    now = time.time() if now is None else now
    decide(session, settings, now, up_since)
    return tend(session, settings, now)


def decide(session: Session, settings: Settings, now: float, up_since: float | None = None) -> None:
    """Lost nodes, unconfirmed stops, allocation: what starts or ends attempts, which the service commits
    before it tends (service/asgi/background.py), so that the launches go out at once. `up_since`: from
    when nodes may be lost (the service's start or its database's return)."""
    if up_since is None or now - up_since >= settings.heartbeat_timeout_seconds:
        _declare_lost_nodes(session, settings, now)
    for share, detail in lost_to_their_peers(session, settings, now, up_since):  # service/jobs/peer_loss.py
        fence(share.node, share, now)
        _lose(session, share.node, [share], detail, settings, now)
    _give_up_unconfirmed_stops(session, settings, now)
    _allocate(session, settings, now)


def tend(session: Session, settings: Settings, now: float) -> float | None:
    """Warm spares, elastic growth, checkpoint intervals; when the next node-loss decision falls due."""
    warm_spares(session, settings, now)  # spares of attempts just started, idle since, or learned imports concern
    for attempt, why in weigh_growing(session, settings, now):  # an elastic job's smaller attempt grows back
        fail_attempt(session, attempt, "grow", why, now)
    retune_auto_intervals(session, settings, now)
    return next_due(session, settings, now)


def _declare_lost_nodes(session: Session, settings: Settings, now: float) -> None:
    deadline = utc_at(now) - timedelta(seconds=settings.heartbeat_timeout_seconds)
    silent = session.scalars(select(Node).where(Node.state != NodeState.lost, Node.last_heartbeat_at < deadline)
                             .with_for_update(skip_locked=True)).all()  # fmt: skip
    for node in silent:
        detail = f"agent {node.name} sent no heartbeat for {settings.heartbeat_timeout_seconds:g} s"
        shares = session.scalars(select(AttemptNode).where(AttemptNode.node_id == node.id,
                                                           AttemptNode.state.in_(ACTIVE))).all()
        _lose(session, node, shares, detail, settings, now)


def _lose(session: Session, node: Node, shares: Sequence[AttemptNode], detail: str, settings: Settings,
          now: float) -> None:
    """Declares the node lost with its active shares: node evidence either way it was found."""
    node.state = NodeState.lost
    node_evidence.node_lost(session, node, shares, detail, settings, utc_at(now))  # unless a job's drill
    for share in shares:
        # The lost node is told to stop too: a slow agent that comes back must not run stale ranks.
        fail_attempt(session, share.attempt, "node_lost", detail, now)
        share.state = AttemptState.failed  # not waited for: the next attempt may start without it


def _give_up_unconfirmed_stops(session: Session, settings: Settings, now: float) -> None:
    """Shares of ended attempts whose agent never confirmed the stop stop holding their node."""
    deadline = utc_at(now) - timedelta(seconds=settings.stop_grace_seconds)
    unconfirmed = session.scalars(
        select(AttemptNode).join(Attempt)
        .where(AttemptNode.state.in_(ACTIVE), Attempt.state.not_in(ACTIVE), Attempt.ended_at < deadline)
    ).all()  # fmt: skip
    for share in unconfirmed:
        share.state = AttemptState.stopped
        _release(session, share.node)


def _allocate(session: Session, settings: Settings, now: float) -> None:
    # Only jobs that may need an attempt are read and locked: a running job whose attempt is
    # still active needs none, and locking all of them every tick made the event ingestion (which
    # takes a key-share lock on the jobs of its events) wait for the tick under load.
    between_attempts = ~select(Attempt.id).where(Attempt.job_id == Job.id, Attempt.state.in_(ACTIVE)).exists()
    candidates = session.scalars(
        select(Job).where(or_(Job.state == JobState.queued, (Job.state == JobState.running) & between_attempts))
        .order_by(Job.state.desc(), Job.submitted_at)  # restarts ("running") before new jobs
        .with_for_update(skip_locked=True)
        .options(selectinload(Job.attempts))  # one query for all jobs' attempts, not one per job each tick
    ).all()  # fmt: skip
    fresh = utc_at(now) - timedelta(seconds=settings.heartbeat_timeout_seconds)
    idle: list[Node] | None = None  # read (and locked) once per tick, by the first job that needs nodes
    capacity: dict[int, tuple[int, int]] = {}  # slots per node -> the fleet's nodes, and those with that many
    for job in candidates:
        if not needs_attempt(session, job, settings, now):
            continue
        if idle is None:
            idle = list(session.scalars(select(Node).where(*assignable(fresh)).order_by(Node.name)
                                        .with_for_update(skip_locked=True)))  # fmt: skip
        spec = job.spec
        serves = served_job(job)  # a Slurm job's allocation's agents
        if serves and not (job.slurm_allocations and job.slurm_allocations[-1].state == SlurmState.running):
            continue  # its allocation's start (and nodes) not yet recorded (service/slurm/)
        avoided = straggler_avoided(job.attempts)  # service/stragglers/
        free = idle + handed_over_nodes(session, job, fresh)  # and its broken attempt's, still being killed
        fitting = [n for n in free if may_take(n, job, avoided)]
        size, reason = elastic_size(session, job, fitting, avoided)  # all its nodes, or an elastic job's fewer
        if size is None and avoided:  # the spare was taken meanwhile: back where it ran, not stranded
            fitting = [n for n in free if may_take(n, job, ())]
            size, reason = elastic_size(session, job, fitting, set())
        if size is None:  # gang: all nodes or none; smaller jobs behind may still fit
            if job.state == JobState.queued and serves is None:  # a Slurm job's reason is Slurm's (service/slurm/)
                slots = spec.procs_per_node
                if slots not in capacity:
                    capacity[slots] = fleet_capacity(session, slots, fresh)
                reason = waiting_reason(spec.nodes, slots, len(fitting), *capacity[slots])
            if reason and job.reason != reason:  # written when it changes, not every tick
                job.reason = reason
            continue
        nodes = rank_order(job, fitting, size)
        start_attempt(session, settings, job, nodes, now, reason or None)
        idle = [node for node in idle if node not in nodes]
