"""Elastic jobs (spec `elastic`, docs/reliability.md "Elastic jobs"): the size a job's next attempt
takes when fewer than its nodes are free, and whether a smaller attempt grows back.

A job shrinks only to a size its own run declared (rank 0's `elastic` event, newest first: the
sizes at which its script keeps its training the same, docs/library.md "Elastic jobs"), at least
`min_nodes`, and only when nodes are really gone (lost, fenced, drained, unhealthy, left out as a
straggler's, taken by another job): its own nodes still stopping its last attempt come back. A run
that never declared waits for its full size, as a job that is not elastic, and says so.

A smaller attempt grows back when free nodes would make a larger declared size (or the full one)
and what that gains over its remaining steps beats a restart, weighed by the straggler policy's
cost model (service/accounting/restart_cost.py). Each size is weighed once per attempt.
"""

from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.accounting.accounts import job_account
from service.jobs.placement import free_spares
from service.accounting.restart_cost import restart_seconds, spends_last_restart
from service.models import ACTIVE_ATTEMPT_STATES as ACTIVE
from service.models import (
    ELASTIC_SIZES,
    STEP_TIMINGS,
    Attempt,
    AttemptNode,
    AttemptState,
    Job,
    JobEvent,
    JobState,
    Node,
    NodeState,
)
from service.settings import Settings

HOW_TO_DECLARE = "its script calls run.elastic(global_batch, micro_batch), docs/library.md \"Elastic jobs\""


def _nodes(count: int) -> str:
    return f"{count} node{'s' if count != 1 else ''}"


def declared_nodes(session: Session, job: Job) -> list[int] | None:
    """The node counts below its full size at which the job's run said it keeps its training the
    same (its newest declaration, from any attempt), ascending; None if it never declared."""
    spec = job.spec
    data = session.scalar(
        select(JobEvent.data).where(JobEvent.job_id == job.id, ELASTIC_SIZES, JobEvent.source == "rank:0")
        .order_by(JobEvent.attempt.desc(), JobEvent.ts.desc(), JobEvent.id.desc()).limit(1)
    )  # fmt: skip
    if data is None:
        return None
    if data.get("full_world_size") != spec.world_size or not isinstance(data.get("world_sizes"), list):
        return []  # a declaration of another job's size tells nothing of this one
    per_node = spec.procs_per_node
    return sorted({w // per_node for w in data["world_sizes"]
                   if isinstance(w, int) and w > 0 and w % per_node == 0 and w // per_node < spec.nodes})  # fmt: skip


def coming_back(session: Session, job: Job, fitting: list[Node], avoided: set[int | None]) -> int:
    """The last attempt's nodes that are not free now but not gone either: still stopping a share of
    the job's ended attempt, or idle without a fresh heartbeat yet (the service just came back)."""
    if not job.attempts:
        return 0
    stopping = set(session.scalars(select(AttemptNode.node_id).join(Attempt).where(
        Attempt.job_id == job.id, Attempt.state.not_in(ACTIVE), AttemptNode.state.in_(ACTIVE))))
    free = {n.id for n in fitting}
    return sum(1 for share in job.attempts[-1].nodes
               if (n := share.node).id not in free and n.id not in avoided and n.state != NodeState.lost
               and n.fenced is None and n.drained is None and n.health is None
               and (n.id in stopping or n.state == NodeState.idle))  # fmt: skip


def elastic_size(session: Session, job: Job, fitting: list[Node], avoided: set[int | None]) -> tuple[int | None, str]:
    """How many of the `fitting` nodes the job's next attempt takes (None: it waits), and the job's
    reason: why it waits, or why it runs on fewer than its nodes ("" for a job that is not elastic
    or has all its nodes: the scheduler's own words)."""
    spec = job.spec
    if len(fitting) >= spec.nodes:
        return spec.nodes, ""
    if spec.elastic is None or spec.elastic.min_nodes >= spec.nodes or job.state != JobState.running:
        return None, ""  # a first attempt starts at full size: its run has declared nothing yet
    short = spec.nodes - len(fitting)
    if coming_back(session, job, fitting, avoided) >= short:
        return None, ""  # an ordinary restart: its own nodes are back in a moment
    declared = declared_nodes(session, job)
    waiting = f"waiting for {_nodes(short)} more (elastic, min_nodes {spec.elastic.min_nodes}, {len(fitting)} free)"
    if declared is None:
        return None, (f"{waiting}: its run never declared the sizes it keeps its training the same at, so it runs "
                      f"at its full size only; to go on with fewer, {HOW_TO_DECLARE}")
    sizes = [k for k in declared if spec.elastic.min_nodes <= k <= len(fitting)]
    if not declared:
        return None, f"{waiting}: its run declared no size below its full one it keeps its training the same at"
    if not sizes:
        said = f"{', '.join(map(str, declared))} node{'s' if declared != [1] else ''}"
        return None, f"{waiting}: its run keeps its training the same at {said}, none of them free and >= min_nodes"
    return max(sizes), (f"running on {max(sizes)} of {spec.nodes} nodes (elastic): {_nodes(short)} lost or left out "
                        "and no spare free; it grows back at a checkpoint once nodes return, where that pays")


def size_without_one(session: Session, attempt: Attempt) -> int | None:
    """The nodes an elastic job's running attempt would go on with, one of its own left out and no
    spare free: the largest size its run declared, at least min_nodes (None: none, or not elastic)."""
    elastic = attempt.job.spec.elastic
    if elastic is None:
        return None
    sizes = [k for k in declared_nodes(session, attempt.job) or [] if elastic.min_nodes <= k < len(attempt.nodes)]
    return max(sizes, default=None)


def weigh_growing(session: Session, settings: Settings, now: float) -> list[tuple[Attempt, str]]:
    """The smaller attempts to stop now (SIGTERM: a final checkpoint) so that the next one runs on
    more nodes, each with why; an attempt that does not grow says why in its job's reason."""
    reduced = session.scalars(select(Attempt).where(Attempt.state == AttemptState.running,
                                                    Attempt.full_nodes.is_not(None))
                              .with_for_update(skip_locked=True)).all()  # fmt: skip
    fresh = datetime.fromtimestamp(now, UTC) - timedelta(seconds=settings.heartbeat_timeout_seconds)
    growing = []
    for attempt in reduced:
        present = len(attempt.nodes)
        free = free_spares(session, attempt, fresh)
        if free == 0:
            continue
        job = attempt.job
        sizes = [k for k in [*(declared_nodes(session, job) or []), job.spec.nodes] if present < k <= present + free]
        if not sizes or max(sizes) <= (attempt.grow_weighed or present):
            continue  # nothing larger fits, or that size was weighed already
        grows, why = weigh(session, attempt, max(sizes))
        if grows is not None:
            attempt.grow_weighed = max(sizes)
        if job.reason != why[:512]:  # written when it changes, not every tick
            job.reason = why[:512]
        if grows:
            growing.append((attempt, why))
    return growing


def weigh(session: Session, attempt: Attempt, target: int) -> tuple[bool | None, str]:
    """Whether the attempt should grow to `target` nodes (None: not measured yet, weighed again
    later), and why. A step at `target` nodes takes its present step times present / target: the
    global batch is kept, so each rank's share of it shrinks as the ranks grow."""
    job, present = attempt.job, len(attempt.nodes)
    growing = f"growing back to {target} of {job.spec.nodes} nodes"
    window = session.scalar(select(JobEvent.data).where(JobEvent.job_id == job.id, JobEvent.attempt == attempt.number,
                                                        STEP_TIMINGS).order_by(JobEvent.step.desc()).limit(1))
    account = job_account(session, job.id)
    summary = account.attempts.get(attempt.number)
    if window is None or summary is None or not summary.steps or summary.last_step is None:
        return None, f"{growing} waits for the attempt's first step times"
    step_seconds = summary.ideal_step_seconds or summary.step_seconds / summary.steps
    total = window.get("total_steps")
    if not isinstance(total, int) or total <= 0:
        return False, (f"not {growing}: its remaining steps are unknown (its ranks report no total_steps: "
                       "run.total_steps, docs/library.md)")
    if last := spends_last_restart(job, "a restart"):
        return False, f"not {growing}: {last}"
    remaining = max(0, total - summary.last_step)
    gain = remaining * step_seconds * (1 - present / target)
    restart = restart_seconds(account, attempt.number, summary.last_step, step_seconds)
    weighed = f"it saves {gain:.1f} s over its {remaining} remaining steps, a restart costs {restart:.1f} s"
    if gain <= restart:
        return False, f"not {growing}: {weighed.replace('it saves', 'it would save')}"
    return True, f"{growing} at a checkpoint: {weighed}"
