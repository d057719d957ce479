"""What a job's `stragglers` policy does with a straggler (docs/reliability.md, "Stragglers").

`report` records it. `replace` weighs what the slowdown will cost over the job's remaining steps
against what a restart without its node costs, and replaces it only where that pays and costs
the job nothing else. It keeps the attempt where it runs, and says why, when:
- the slowness follows the rank: it was flagged on another node of the job before (its data or its
  work is slow, not the node), so a third node would be no faster;
- no spare node is free: the wait for one has no bound, while the job can go on now (an elastic
  job goes on without the node, on a smaller size its run declared, when the slowdown costs more
  than the restart and the remaining steps at that size: service/jobs/elastic.py);
- a replacement would spend the job's last restart (max_restarts): a real failure after it would
  then fail a job that would have finished at its slower pace;
- the restart costs more than the slowdown.
A flag never drains the node: the step times are the job's own words (its ranks write them, and a
rank that sleeps is slow); a node slow in several jobs shows in `ett nodes` (service/agents/nodes.py).
"""

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.accounting.accounts import job_account
from service.accounting.engine import JobAccount
from service.jobs.elastic import size_without_one
from service.jobs.placement import free_spares
from service.accounting.restart_cost import restart_seconds, spends_last_restart
from service.models import Attempt, Node, StragglerFlag
from service.stragglers.scoring import Straggler


@dataclass(frozen=True)
class Decision:
    action: str  # reported, replaced, or kept (the policy is `replace`, and `reason` says why it did not)
    reason: str | None
    follows_rank: bool  # flagged on another node of the job before: the cause is not the node
    slow_cost: float = 0.0
    restart_cost: float = float("inf")
    spare: bool = False  # replaced onto a free spare, held for it (service/stragglers/spares.py)


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
    spares = free_spares(session, attempt, fresh)
    # No spare free: an elastic job goes on without the node, on fewer (service/jobs/elastic.py), where that pays.
    smaller = None if spares else size_without_one(session, attempt)
    if smaller is not None:
        restart_cost += shrinking_cost(s, len(attempt.nodes), smaller)
    reasons = [follows] if follows else []
    if slow_cost <= restart_cost:
        fewer = "" if smaller is None else f" on {smaller} nodes (no spare free)"
        reasons.append(f"the slowdown would cost {slow_cost:.1f} s, a restart{fewer} {restart_cost:.1f} s")
    if not spares and smaller is None:
        reasons.append("no spare node was free")
    if last := spends_last_restart(job, "a replacement"):
        reasons.append(last)
    action = "kept" if reasons else "replaced"
    return Decision(action, "; ".join(reasons) or None, bool(before), slow_cost, restart_cost,
                    spare=action == "replaced" and spares > 0)


def remaining_steps(s: Straggler) -> int:
    """The job's steps left as its ranks report its total, else as many again as it has made."""
    return max(0, s.total_steps - s.flagged_step) if s.total_steps else s.flagged_step


def shrinking_cost(s: Straggler, present: int, smaller: int) -> float:
    """What running the remaining steps on `smaller` nodes than `present` costs: the global batch
    is kept, so a healthy step (the straggler's lag taken off) takes present / smaller as long."""
    healthy = max(0.0, s.step_seconds - (s.work_seconds - s.peer_seconds))
    return remaining_steps(s) * healthy * (present / smaller - 1)


def replacement_costs(account: JobAccount, number: int, s: Straggler) -> tuple[float, float]:
    """(what the slowdown costs over the remaining steps, what a restart costs), in seconds. The
    remaining steps are the job's total as its ranks report it (the trainer, the Hugging Face
    Trainer, `run.total_steps`), else as many again as it has made; a restart's cost is
    service/accounting/restart_cost.py's."""
    slow_cost = (s.work_seconds - s.peer_seconds) * remaining_steps(s)
    return slow_cost, restart_seconds(account, number, s.flagged_step, s.step_seconds)
