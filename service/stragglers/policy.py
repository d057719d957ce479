"""What a job's `stragglers` policy does with a straggler (docs/reliability.md, "Stragglers").

`report` records it. `replace` weighs what the slowdown will cost over the job's remaining steps
against what a restart without its node costs, and replaces it only where that pays and costs
the job nothing else. It keeps the attempt where it runs, and says why, when:
- the slowness follows the rank: it was flagged on another node of the job before (its data or its
  work is slow, not the node), so a third node would be no faster;
- no spare node is free: the wait for one has no bound, while the job can go on now;
- a replacement would spend the job's last restart (max_restarts): a real failure after it would
  then fail a job that would have finished at its slower pace;
- the restart costs more than the slowdown.
A flag never drains the node: the step times are the job's own words (its ranks write them, and a
rank that sleeps is slow); a node slow in several jobs shows in `ett nodes` (service/agents/nodes.py).
"""

import statistics
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.accounting.accounts import job_account
from service.accounting.engine import AttemptSummary, JobAccount
from service.models import Attempt, Node, NodeState, StragglerFlag
from service.stragglers.scoring import Straggler


@dataclass(frozen=True)
class Decision:
    action: str  # reported, replaced, or kept (the policy is `replace`, and `reason` says why it did not)
    reason: str | None
    follows_rank: bool  # flagged on another node of the job before: the cause is not the node
    slow_cost: float = 0.0
    restart_cost: float = float("inf")


def decide(session: Session, attempt: Attempt, s: Straggler, node: Node, fresh: datetime) -> Decision:
    """The policy's answer for a straggler of the running `attempt` on `node`; `fresh`: the oldest
    heartbeat of a live node."""
    job = attempt.job
    before = sorted(set(session.scalars(select(StragglerFlag.node).where(
        StragglerFlag.job_id == job.id, StragglerFlag.rank == s.rank, StragglerFlag.node != node.name))))
    follows = (f"rank {s.rank} was slow on {', '.join(before)} too: the slowness follows the rank (its data or its "
               "work), not the node") if before else None  # fmt: skip
    if job.spec.stragglers != "replace":
        return Decision("reported", follows, bool(before))
    slow_cost, restart_cost = replacement_costs(job_account(session, job.id), attempt.number, s)
    reasons = [follows] if follows else []
    if slow_cost <= restart_cost:
        reasons.append(f"the slowdown would cost {slow_cost:.1f} s, a restart {restart_cost:.1f} s")
    if free_spares(session, attempt, fresh) == 0:
        reasons.append("no spare node was free")
    if job.restarts + 1 >= job.spec.max_restarts:
        reasons.append(f"a replacement would spend the job's last restart (max_restarts {job.spec.max_restarts})")
    action = "kept" if reasons else "replaced"
    return Decision(action, "; ".join(reasons) or None, bool(before), slow_cost, restart_cost)


def free_spares(session: Session, attempt: Attempt, fresh: datetime) -> int:
    """The nodes the scheduler could give the attempt's next one in place of a node of it: idle,
    alive, healthy, not drained or fenced, serving the same jobs, with its slots, not already
    left out for a straggler of the job (service/jobs/scheduler.py's allocation)."""
    job = attempt.job
    serves = job.id if job.spec.slurm is not None else None
    taken = {share.node_id for share in attempt.nodes} | {a.failed_node_id for a in job.attempts
                                                          if a.cause == "straggler"}  # fmt: skip
    query = select(func.count()).select_from(Node).where(
        Node.state == NodeState.idle, Node.last_heartbeat_at >= fresh, Node.health.is_(None),
        Node.drained.is_(None), Node.fenced.is_(None), Node.slots >= job.spec.procs_per_node,
        Node.job_id.is_(None) if serves is None else Node.job_id == serves,
        Node.id.not_in([t for t in taken if t is not None]))  # fmt: skip
    return session.scalar(query) or 0


def replacement_costs(account: JobAccount, number: int, s: Straggler) -> tuple[float, float]:
    """(what the slowdown costs over the remaining steps, what a restart costs), in seconds. The
    remaining steps are the job's total as its ranks report it (the trainer, the Hugging Face
    Trainer, `run.total_steps`), else as many again as it has made. A restart costs its handover
    (the stop, which saves a checkpoint and waits for it, and the wait for the next attempt's
    nodes), the next attempt's start-up (restore included) and warm-up, and the steps lost by a
    script that does not checkpoint through ETT: each as this attempt, or the job's earlier
    restarts, measured it."""
    remaining = max(0, s.total_steps - s.flagged_step) if s.total_steps else s.flagged_step
    slow_cost = (s.work_seconds - s.peer_seconds) * remaining
    summary = account.attempts.get(number)
    if summary is None or summary.start is None or summary.first_step_start is None:
        return slow_cost, float("inf")  # nothing measured yet: no restart
    startup = max(0.0, summary.first_step_start - summary.start)
    checkpoints = summary.committed > 0 or summary.blocking_count > 0
    lost = 0.0 if checkpoints else (s.flagged_step - (summary.restored_step or 0)) * s.step_seconds
    return slow_cost, handover_seconds(account, summary) + startup + warmup_seconds(summary) + lost


def handover_seconds(account: JobAccount, summary: AttemptSummary) -> float:
    """From an attempt's end to its successor's allocation: the median of the job's earlier
    restarts where it has any, else the stop's final save (this attempt's mean save)."""
    gaps = [a.start - account.attempts[n - 1].failed_at for n, a in account.attempts.items()
            if n - 1 in account.attempts and a.start is not None and account.attempts[n - 1].failed_at is not None]
    if gaps:
        return max(0.0, statistics.median(gaps))
    if summary.commit_count:
        return summary.commit_seconds / summary.commit_count
    return summary.blocking_seconds / summary.blocking_count if summary.blocking_count else 0.0


def warmup_seconds(summary: AttemptSummary) -> float:
    """What this attempt's first steps took beyond its pace: what the next one's will take again."""
    ideal = summary.ideal_step_seconds
    if ideal is None:
        return 0.0
    return sum(max(0.0, seconds - ideal) for _, seconds in summary.step_windows["early"])
