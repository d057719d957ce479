"""Fleet figures: the job report's figures summed over many jobs, inside a time window.

Each job's attempts are cut into pieces (report.attempt_pieces) and the pieces clipped to
[since, until]. Start-up, restore and the tail after the last activity are exact; a window edge
falling inside an attempt's training stretch takes its share of that stretch's categories in
proportion to the time inside. Failures, restarts and starts count when they happen in the window;
checkpoint figures come from the attempts that overlap it.
"""

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from service.accounting.engine import CATEGORIES, JobAccount
from service.accounting.report import attempt_pieces, attempt_spans, failures_of, window_of


@dataclass(frozen=True)
class FleetJob:
    name: str
    account: JobAccount
    job_id: str = ""


class _Totals:
    def __init__(self) -> None:
        self.jobs = 0
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.failures = self.restarts = self.committed = self.blocking_count = 0
        self.recover: list[float] = []
        self.starts: list[float] = []
        self.blocking_seconds = self.slow_seconds = 0.0
        self.causes: dict[str, int] = defaultdict(int)
        self.diagnoses: dict[str, int] = defaultdict(int)

    def figures(self) -> dict[str, Any]:
        wall = sum(self.seconds.values())
        return {
            "jobs": self.jobs,
            "wall_seconds": wall,
            "ett_percent": 100.0 * self.seconds["productive"] / wall if wall > 0 else 0.0,
            "seconds": self.seconds,
            "slow_seconds": self.slow_seconds,
            "full_speed_percent": 100.0 * (self.seconds["productive"] - self.slow_seconds) / wall if wall > 0 else 0.0,
            "failures": self.failures,
            "failure_causes": dict(sorted(self.causes.items(), key=lambda item: (-item[1], item[0]))),
            "failure_diagnoses": dict(sorted(self.diagnoses.items(), key=lambda item: (-item[1], item[0]))),
            "restarts": self.restarts,
            "mtbf_seconds": wall / self.failures if self.failures else None,
            "mean_time_to_recover_seconds": sum(self.recover) / len(self.recover) if self.recover else None,
            "mean_time_to_start_seconds": sum(self.starts) / len(self.starts) if self.starts else None,
            "checkpoints": {
                "committed": self.committed,
                "mean_blocking_seconds": self.blocking_seconds / self.blocking_count if self.blocking_count else None,
            },
        }


def _add_job(totals: _Totals, account: JobAccount, now: float, since: float, until: float) -> None:
    window = window_of(account, now)
    if window is None or window[1] <= since or window[0] >= until:
        return
    totals.jobs += 1
    spans = attempt_spans(account, window[1])
    for i, span in enumerate(spans):
        if span.end < since or span.start >= until:
            continue
        a = span.summary
        productive = 0.0
        for piece in attempt_pieces(span, account.finished_at is not None):
            for k, v in piece.clipped(since, until).items():
                totals.seconds[k] += v
                productive += v if k == "productive" else 0.0
        # An attempt's slow time, in the share of its productive time the window holds.
        kept = a.step_seconds - a.wasted_seconds
        totals.slow_seconds += min(productive, a.slow_seconds * productive / kept) if kept > 0 else 0.0
        totals.restarts += int(i > 0 and since <= span.start < until)
        totals.committed += a.committed
        totals.blocking_count += a.blocking_count
        totals.blocking_seconds += a.blocking_seconds
    first_steps = [s.summary.first_step_start for s in spans if s.summary.first_step_start is not None]
    if first_steps and since <= window[0] < until:
        totals.starts.append(min(first_steps) - window[0])
    for failure in failures_of(spans):
        if since <= failure["at"] < until:
            totals.failures += 1
            totals.causes[failure["cause"] or "unknown"] += 1
            totals.diagnoses[failure["diagnosis"] or "unknown"] += 1
            if failure["time_to_recover_seconds"] is not None:
                totals.recover.append(failure["time_to_recover_seconds"])


def fleet_report(
    jobs: list[FleetJob], *, now: float, since: float | None = None, until: float | None = None
) -> dict[str, Any]:
    """The fleet's figures over [since, until] (default: all time to now), and per job name."""
    lo = -math.inf if since is None else since
    hi = now if until is None else until
    fleet, by_name, by_job = _Totals(), defaultdict(_Totals), {}
    for job in jobs:
        _add_job(fleet, job.account, now, lo, hi)
        _add_job(by_name[job.name], job.account, now, lo, hi)
        _add_job(by_job.setdefault(job.job_id, _Totals()), job.account, now, lo, hi)
    names = {name: t.figures() for name, t in sorted(by_name.items()) if t.jobs}
    each = {job.job_id: {"name": job.name, **by_job[job.job_id].figures()} for job in jobs if by_job[job.job_id].jobs}
    return {"since": since, "until": hi, **fleet.figures(), "by_name": names, "by_job": each}
