"""Why an attempt failed, from the evidence (docs/reliability.md, "Failure diagnosis").

The agent reports how a rank ended (an exit code, a signal, a hang) and ships its output; this
reads both: the last lines of the rank the failure names, matched against one table of patterns
(service/failures/failure_text.py; an operator adds theirs first with ETT_FAILURE_PATTERNS), give the
failure's diagnosis and a one-line summary, e.g. `exception` and `ValueError: bad batch`. A failure
no line explains is told by its cause (a hang, a lost node, Slurm's end) or its exit code, else
`unknown`. The heartbeats diagnose before the transaction that records a failure (diagnose_reports).
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session, sessionmaker

from ett.protocol import EXIT_CONFIG_ERROR
from ett.protocol.messages import AttemptReport
from service.failures.failure_text import (
    DEFAULT_COMPILED,
    SUMMARY_CHARS,
    Diagnosis,
    compile_patterns,
    failure_key,
    last_lines,
    read_lines,
)
from service.ingest.logs import rank_named
from service.models import Attempt, Job, RankLog
from service.settings import Settings

# Failures no restart can fix: the job ends at once.
NEVER_RETRIED = frozenset({"import_error", "configuration"})
# Told by the failure's cause alone.
CAUSE_DIAGNOSES = {"hang": "hang", "node_lost": "node_lost", "time_limit": "time_limit", "preempted": "preempted",
                   "terminated": "terminated", "straggler": "straggler", "grow": "grow"}
LogKey = tuple[str, int, int]  # (job id, attempt, rank)


@dataclass(frozen=True)
class FailurePolicy:
    """The operator's settings for failures (service/settings.py): the extra patterns, and how much
    node evidence a node may have within a window before it is drained. A diagnosis never counts
    against the node: it is read from what the job printed (service/agents/node_evidence.py)."""

    patterns: Sequence[tuple[str, re.Pattern[str]]] = tuple(DEFAULT_COMPILED)
    node_failure_limit: int = 3
    node_failure_window_seconds: float = 3600.0

    @classmethod
    def of(cls, settings: Settings) -> "FailurePolicy":
        return cls(compile_patterns(settings.failure_patterns), settings.node_failure_limit,
                   settings.node_failure_window_seconds)


def without_logs(cause: str, detail: str, exit_code: int | None) -> Diagnosis:
    """What a failure's cause and exit code alone tell."""
    if cause in CAUSE_DIAGNOSES:
        return Diagnosis(CAUSE_DIAGNOSES[cause], detail[:SUMMARY_CHARS])
    if exit_code == EXIT_CONFIG_ERROR:
        return Diagnosis("configuration", detail[:SUMMARY_CHARS])
    return Diagnosis("signal" if cause == "signal" else "unknown", detail[:SUMMARY_CHARS])


def reported_failure(report: AttemptReport, node_name: str) -> tuple[str, str]:
    """A failed report's cause and detail (one said for it when the agent gave none)."""
    return report.cause or "exit", report.detail or f"{report.cause} on {node_name}"


def rank_to_read(cause: str, detail: str, exit_code: int | None) -> int | None:
    """The rank whose output may tell the failure (the one its detail names); None when its cause
    or exit code alone tells, or it names none."""
    if cause in CAUSE_DIAGNOSES or exit_code == EXIT_CONFIG_ERROR:
        return None
    return rank_named(detail)


def conclude(cause: str, detail: str, exit_code: int | None, log: str | None,
             patterns: Sequence[tuple[str, re.Pattern[str]]] = DEFAULT_COMPILED) -> Diagnosis:
    """The failure's diagnosis: from the last lines of its rank's `log` (bounded: at most TAIL_LINES
    lines of LINE_CHARS characters, service/failures/failure_text.py) when they tell, else its cause."""
    if rank_to_read(cause, detail, exit_code) is not None:
        # The detail last: the agent's word on a kill (the kernel's out-of-memory killer).
        found = read_lines([*last_lines(log or ""), detail], patterns)
        if found is not None:
            return found
    return without_logs(cause, detail, exit_code)


def diagnose(session: Session, attempt: Attempt, cause: str, detail: str, exit_code: int | None,
             patterns: Sequence[tuple[str, re.Pattern[str]]] = DEFAULT_COMPILED) -> Diagnosis:
    """The failure's diagnosis, its rank's output read in the caller's transaction (the heartbeats
    diagnose before theirs: diagnose_reports)."""
    rank = rank_to_read(cause, detail, exit_code)
    key = (attempt.job_id, attempt.number, rank)
    return conclude(cause, detail, exit_code, None if rank is None else rank_logs(session, {key}).get(key), patterns)


def diagnose_reports(sessions: sessionmaker[Session], failed: Sequence[tuple[str, AttemptReport]],
                     patterns: Sequence[tuple[str, re.Pattern[str]]]) -> list[Diagnosis]:
    """The diagnoses of failed reports, (node name, report) pairs: their ranks' output read in one
    short transaction of its own, then matched with no transaction open, so no lock waits on the
    text a job wrote."""
    failures = [(report.job_id, report.attempt, *reported_failure(report, name), report.exit_code)
                for name, report in failed]
    keys = [(job_id, attempt, rank_to_read(cause, detail, code)) for job_id, attempt, cause, detail, code in failures]
    wanted = {key for key in keys if key[2] is not None}
    logs: dict[LogKey, str] = {}
    if wanted:
        with sessions() as session:
            logs = rank_logs(session, wanted)
    return [conclude(cause, detail, code, logs.get(key), patterns)
            for (_, _, cause, detail, code), key in zip(failures, keys, strict=True)]


def rank_logs(session: Session, keys: set[LogKey]) -> dict[LogKey, str]:
    """The kept output of these ranks, by (job id, attempt, rank)."""
    rows = session.execute(select(RankLog.job_id, RankLog.attempt, RankLog.rank, RankLog.text).where(
        tuple_(RankLog.job_id, RankLog.attempt, RankLog.rank).in_(list(keys))))  # fmt: skip
    return {(row.job_id, row.attempt, row.rank): row.text for row in rows}


def restart_loop(attempts: Sequence[Attempt], newest_checkpoint: str | None, limit: int) -> str | None:
    """Why the job must not restart again, if its last `limit` attempts all failed alike and made
    no progress: the same diagnosis and summary (but for its numbers and addresses: failure_key),
    each resumed from the same checkpoint, and no newer one committed since (None: a restart may help)."""
    failed = [a for a in attempts if a.diagnosis is not None][-limit:]
    if len(failed) < limit or len(failed) != len(attempts[-limit:]):
        return None
    first = failed[0]
    alike = {(a.diagnosis, failure_key(a.summary), a.resume_from) for a in failed}
    if len(alike) > 1 or newest_checkpoint != first.resume_from:
        return None
    return (f"the same failure {limit} times in a row, with no progress past it (each attempt resumed from "
            f"{first.resume_from or 'the start'}): {first.diagnosis}: {first.summary}; not restarted again "
            "(max_same_failures)")


def no_restart_reason(job: Job, diagnosis: Diagnosis, detail: str, exit_code: int | None,
                      newest_checkpoint: str | None) -> str | None:
    """Why a job whose attempt just failed must not restart (None: it may): a failure no restart
    fixes, its restarts spent, or the same failure again and again."""
    if exit_code == EXIT_CONFIG_ERROR:
        return f"configuration error (exit code {exit_code}), not retried: {detail}"
    if diagnosis.kind in NEVER_RETRIED:
        return f"{diagnosis.kind}, not retried: {diagnosis.summary}"
    if exit_code in job.spec.no_retry_exit_codes:
        return f"exit code {exit_code} is in the job's no_retry_exit_codes, not retried: {detail}"
    looping = restart_loop(job.attempts, newest_checkpoint, job.spec.max_same_failures)
    if looping is not None:
        return looping
    if job.restarts >= job.spec.max_restarts:
        return f"failed after {job.restarts} restarts: {detail}"
    return None
