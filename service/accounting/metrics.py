"""The ETT figures for Prometheus (names in docs/ett.md), served by /metrics (service/asgi/metrics.py).

They are read from the database at scrape time by a custom collector, so every service process
answers the same whatever process ingested the events. Per-job series exist only for running
jobs and jobs finished within `metrics_recent_seconds`, so cardinality stays bounded.
"""

import time
from collections.abc import Iterator
from datetime import UTC, datetime

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from service.accounting.accounts import fleet_mtbf_seconds, with_causes
from service.accounting.engine import CATEGORIES, JobAccount
from service.accounting.report import build_report
from service.models import Attempt, AttemptState, Checkpoint, Job, JobAccountRow, JobState, StragglerFlag
from service.settings import Settings

BLOCKING_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
JOB_LABELS = ["job_id", "job_name"]


class EttCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session], settings: Settings) -> None:
        self.sessions, self.settings = sessions, settings

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        with self.sessions() as session:
            yield from self._collect(session, now)

    def _collect(self, session: Session, now: float) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("ett_jobs", "Jobs by state.", labels=["state"])
        counts = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
        for state in JobState:
            jobs.add_metric([state.value], counts.get(state, 0))
        yield jobs

        cutoff = now - self.settings.metrics_recent_seconds
        rows = session.execute(
            select(Job, JobAccountRow.account)
            .join(JobAccountRow, JobAccountRow.job_id == Job.id)
            .where(
                or_(
                    Job.state == JobState.running,
                    Job.finished_at >= datetime.fromtimestamp(cutoff, UTC),
                    func.coalesce(JobAccountRow.finished_at, JobAccountRow.last_event_at) >= cutoff,
                )
            )
            .order_by(Job.id)
        ).all()
        fleet_mtbf = fleet_mtbf_seconds(session, now)
        g = {name: GaugeMetricFamily(f"ett_job_{name}", text, labels=JOB_LABELS) for name, text in (
            ("ett_ratio", "Share of the job's wall time in kept training steps (0-1)."),
            ("full_speed_ratio", "The ETT ratio less the slow share: kept steps at the ideal step time (0-1)."),
            ("slow_seconds", "Kept steps' time above each attempt's ideal step (docs/ett.md, Slow time)."),
            ("capacity_ratio", "Productive node-seconds over wall x the full size (0-1): the ETT ratio less the "
                               "reduced share."),
            ("reduced_capacity_seconds", "Productive seconds short of the full size: (N - n) / N of each productive "
                                         "second on n of N nodes (docs/ett.md, Reduced capacity)."),
            ("wall_seconds", "The job's accounted wall time: first allocation to finish (or now)."),
            ("queued_seconds", "Time from submission to the first allocation."),
            ("time_to_start_seconds", "First allocation to the first step's start."),
            ("time_to_recover_seconds", "The last failure's time to recover: last step end to next first step start."),
            ("mtbf_seconds", "Wall time over failures."),
            ("step_seconds", "Mean duration of the job's steps."),
            ("last_step", "Highest step number reached."),
            ("last_committed_step", "Step of the newest committed checkpoint."),
            ("recommended_checkpoint_interval_seconds", "Young's interval: sqrt(2 * blocking * MTBF)."),
        )}  # fmt: skip
        seconds = GaugeMetricFamily("ett_job_seconds", "Wall time by ETT category.", labels=[*JOB_LABELS, "category"])
        c = {name: CounterMetricFamily(f"ett_job_{name}", text, labels=JOB_LABELS) for name, text in (
            ("failures", "Failed attempts."),
            ("restarts", "Attempts after the first."),
            ("steps", "Step events accounted (kept and rolled back)."),
            ("checkpoints_committed", "Committed checkpoints."),
        )}  # fmt: skip
        fleet = dict.fromkeys(CATEGORIES, 0.0)
        diagnoses = CounterMetricFamily("ett_fleet_failures", "Failed attempts of the jobs exported here, by "
                                        "diagnosis (docs/reliability.md).", labels=["diagnosis"])
        by_diagnosis: dict[str, int] = {}
        names: dict[str, str] = {}
        slowdowns: dict[str, dict] = {}  # job id -> the slowdown its newest attempt is in
        for job, account_state in rows:
            labels = [job.id, job.name]
            names[job.id] = job.name
            account = JobAccount.from_dict(account_state)
            r = build_report(
                account, job_id=job.id, state=job.state.value, now=now,
                submitted_at=job.submitted_at.timestamp(), fleet_mtbf_seconds=fleet_mtbf,
                ended_at=job.finished_at.timestamp() if job.finished_at else None,
            )  # fmt: skip
            attempts = account.attempts.values()
            newest = max(account.attempts, default=None)
            slowdowns.update({job.id: s for s in r["slowdowns"] if s["ongoing"] and s["attempt"] == newest})
            steps = sum(a.steps for a in attempts)
            recovered = [f["time_to_recover_seconds"] for f in r["failures"]]
            recovered = [t for t in recovered if t is not None]
            values = {
                "ett_ratio": r["ett_percent"] / 100.0,
                "full_speed_ratio": r["full_speed_percent"] / 100.0,
                "slow_seconds": r["slow_seconds"],
                "capacity_ratio": r["capacity_percent"] / 100.0,
                "reduced_capacity_seconds": r["reduced_capacity_seconds"],
                "wall_seconds": r["wall_seconds"],
                "queued_seconds": r["queued_seconds"],
                "time_to_start_seconds": r["time_to_start_seconds"],
                "time_to_recover_seconds": recovered[-1] if recovered else None,
                "mtbf_seconds": r["mtbf_seconds"],
                "step_seconds": sum(a.step_seconds for a in attempts) / steps if steps else None,
                "last_step": max((a.last_step or 0 for a in attempts), default=0) if steps else None,
                "last_committed_step": r["checkpoints"]["last_committed_step"],
                "recommended_checkpoint_interval_seconds": r["recommended_checkpoint_interval_seconds"],
            }
            for name, value in values.items():
                if value is not None:
                    g[name].add_metric(labels, value)
            for category, value in r["seconds"].items():
                seconds.add_metric([*labels, category], value)
                fleet[category] += value
            c["failures"].add_metric(labels, len(r["failures"]))
            for failure in r["failures"]:
                kind = failure["diagnosis"] or "unknown"
                by_diagnosis[kind] = by_diagnosis.get(kind, 0) + 1
            c["restarts"].add_metric(labels, r["restarts"])
            c["steps"].add_metric(labels, steps)
            c["checkpoints_committed"].add_metric(labels, r["checkpoints"]["committed"])
        yield from g.values()
        yield seconds
        yield from c.values()
        yield self._blocking_histogram(session, names)
        yield self._stragglers(session, names)
        yield self._slowdowns(session, names, slowdowns)
        yield self._failed_saves(session, names)
        wall = sum(fleet.values())
        yield GaugeMetricFamily(
            "ett_fleet_ett_ratio", "ETT ratio over the jobs exported here (running and recently finished).",
            value=fleet["productive"] / wall if wall > 0 else 0.0,
        )  # fmt: skip
        fleet_seconds = GaugeMetricFamily(
            "ett_fleet_seconds", "Wall time by category over the jobs exported here.", labels=["category"]
        )
        for category, value in fleet.items():
            fleet_seconds.add_metric([category], value)
        yield fleet_seconds
        for kind, count in sorted(by_diagnosis.items()):
            diagnoses.add_metric([kind], count)
        yield diagnoses

    @staticmethod
    def _stragglers(session: Session, names: dict[str, str]) -> GaugeMetricFamily:
        """The ranks flagged as stragglers in each job's running attempt, by node and rank."""
        gauge = GaugeMetricFamily("ett_job_straggler", "A rank of the job's running attempt its peers wait for "
                                  "(its work over theirs).", labels=[*JOB_LABELS, "node", "rank"])
        running = select(StragglerFlag).join(Attempt, (Attempt.job_id == StragglerFlag.job_id)
                                             & (Attempt.number == StragglerFlag.attempt))
        for flag in session.scalars(running.where(Attempt.state == AttemptState.running)):
            if flag.job_id in names:
                gauge.add_metric([flag.job_id, names[flag.job_id], flag.node, str(flag.rank)], flag.relative)
        return gauge

    @staticmethod
    def _slowdowns(session: Session, names: dict[str, str], ongoing: dict[str, dict]) -> GaugeMetricFamily:
        """Each job's newest attempt's lasting slowdown while it goes on (its step over its ideal
        step), by cause: a straggler's, or the whole job's."""
        gauge = GaugeMetricFamily("ett_job_slowdown", "The newest attempt's lasting slowdown while it goes on: "
                                  "its step over its ideal step.", labels=[*JOB_LABELS, "cause"])
        if not ongoing:
            return gauge
        flagged = {(job_id, attempt) for job_id, attempt in session.execute(
            select(StragglerFlag.job_id, StragglerFlag.attempt).where(StragglerFlag.job_id.in_(list(ongoing))))}
        for job_id, slowdown in ongoing.items():
            [told] = with_causes([slowdown], {attempt for j, attempt in flagged if j == job_id})
            gauge.add_metric([job_id, names[job_id], told["cause"]], told["factor"])
        return gauge

    @staticmethod
    def _failed_saves(session: Session, names: dict[str, str]) -> CounterMetricFamily:
        """Checkpoint saves that failed (ckpt_failed) per job, 0 for a job without one."""
        family = CounterMetricFamily("ett_job_checkpoints_failed", "Checkpoint saves that failed.", labels=JOB_LABELS)
        query = (
            select(Checkpoint.job_id, func.count())
            .where(Checkpoint.job_id.in_(list(names)), Checkpoint.failed_at.is_not(None))
            .group_by(Checkpoint.job_id)
        )
        failed = dict(session.execute(query).all()) if names else {}
        for job_id, name in names.items():
            family.add_metric([job_id, name], failed.get(job_id, 0))
        return family

    @staticmethod
    def _blocking_histogram(session: Session, names: dict[str, str]) -> HistogramMetricFamily:
        """Blocking time of each save (ckpt_start -> ckpt_staged), bucketed by the database."""
        family = HistogramMetricFamily(
            "ett_job_checkpoint_blocking_seconds", "Blocking part of each checkpoint save.", labels=JOB_LABELS
        )
        if not names:
            return family
        blocking = Checkpoint.staged_at - Checkpoint.started_at
        counts = [func.sum(case((blocking <= b, 1), else_=0)) for b in BLOCKING_BUCKETS]
        query = (
            select(Checkpoint.job_id, func.count(), func.sum(blocking), *counts)
            .where(Checkpoint.job_id.in_(list(names)), Checkpoint.staged_at.is_not(None),
                   Checkpoint.started_at.is_not(None))
            .group_by(Checkpoint.job_id)
        )  # fmt: skip
        for job_id, count, total, *cumulative in session.execute(query):
            buckets = [(str(b), n) for b, n in zip(BLOCKING_BUCKETS, cumulative, strict=True)] + [("+Inf", count)]
            family.add_metric([job_id, names[job_id]], buckets, float(total))
        return family
