"""What a restart costs a running job, as it measured it: the cost model a voluntary restart is
weighed by, a straggler's replacement (service/stragglers/policy.py) and an elastic job's growing
back (service/jobs/elastic.py) alike."""

import statistics

from service.accounting.engine import AttemptSummary, JobAccount
from service.models import Job


def restart_seconds(account: JobAccount, number: int, step: int, step_seconds: float) -> float:
    """What restarting attempt `number`, now at `step` with steps of `step_seconds`, costs: its
    handover (the stop, which saves a checkpoint and waits for it, and the wait for the next
    attempt's nodes), the next attempt's start-up (restore included) and warm-up, and the steps lost
    by a script that does not checkpoint through ETT: each as this attempt, or the job's earlier
    restarts, measured it. Infinite while nothing is measured yet."""
    summary = account.attempts.get(number)
    if summary is None or summary.start is None or summary.first_step_start is None:
        return float("inf")
    startup = max(0.0, summary.first_step_start - summary.start)
    checkpoints = summary.committed > 0 or summary.blocking_count > 0
    lost = 0.0 if checkpoints else (step - (summary.restored_step or 0)) * step_seconds
    return handover_seconds(account, summary) + startup + warmup_seconds(summary) + lost


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


def spends_last_restart(job: Job, restart: str) -> str | None:
    """Why a voluntary `restart` ("a replacement") must not happen now: it would spend the job's last
    restart, and a real failure after it would then fail a job that would have finished as it runs."""
    if job.restarts + 1 >= job.spec.max_restarts:
        return f"{restart} would spend the job's last restart (max_restarts {job.spec.max_restarts})"
    return None
