"""Why an attempt failed, from the evidence (docs/reliability.md, "Failure diagnosis").

The agent reports how a rank ended (an exit code, a signal, a hang) and ships its output; this
reads both: the last lines of the rank the failure names, matched against one table of patterns
(an operator adds theirs first with ETT_FAILURE_PATTERNS), give the failure's diagnosis and a
one-line summary, e.g. `exception` and `ValueError: bad batch`. A failure no line explains is
told by its cause (a hang, a lost node, Slurm's end) or its exit code, else `unknown`.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from ett.protocol import EXIT_CONFIG_ERROR
from service.jobs.logs import rank_named
from service.models import Attempt, Job, Node, RankLog
from service.settings import Settings

# (diagnosis, pattern): the first diagnosis whose pattern matches a line of the rank's last
# output wins (so the specific before the general: a CUDA out-of-memory is also an exception);
# the summary is the last line it matched.
DEFAULT_PATTERNS: tuple[tuple[str, str], ...] = (
    ("import_error", r"^(?:ModuleNotFoundError|ImportError): .+"),
    ("cuda_out_of_memory", r"(?:torch\.(?:cuda\.)?OutOfMemoryError|CUDA out of memory)"),
    ("out_of_memory", r"^MemoryError\b|Cannot allocate memory|std::bad_alloc|out-of-memory killer"),
    ("collective_timeout", r"Watchdog caught collective operation timeout|NCCL.*[Tt]imed? ?out|[Gg]loo.*[Tt]imed out"),
    ("hardware_error",
     r"\bXid\b|uncorrectable ECC|CUDA error: (?:an illegal memory access|unspecified launch failure)"),
    ("disk_full", r"No space left on device|Disk quota exceeded"),
    ("exception", r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt)\w*(?::.*)?$"),
)
# Failures no restart can fix: the job ends at once.
NEVER_RETRIED = frozenset({"import_error", "configuration"})
# Told by the failure's cause alone.
CAUSE_DIAGNOSES = {"hang": "hang", "node_lost": "node_lost", "time_limit": "time_limit", "preempted": "preempted",
                   "terminated": "terminated", "straggler": "straggler"}
TAIL_LINES = 60
SUMMARY_CHARS = 240


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    summary: str


def compile_patterns(extra: Sequence[tuple[str, str]] = ()) -> list[tuple[str, re.Pattern[str]]]:
    return [(kind, re.compile(pattern)) for kind, pattern in (*extra, *DEFAULT_PATTERNS)]


DEFAULT_COMPILED = compile_patterns()
# Diagnoses of the job's own making: they do not count against the node that reported them.
JOBS_OWN = frozenset({"exception", "import_error", "configuration"})


@dataclass(frozen=True)
class FailurePolicy:
    """The operator's settings for failures (service/settings.py): the extra patterns, and how many
    failures a node may report within a window before it is drained."""

    patterns: Sequence[tuple[str, re.Pattern[str]]] = tuple(DEFAULT_COMPILED)
    node_failure_limit: int = 3
    node_failure_window_seconds: float = 3600.0

    @classmethod
    def of(cls, settings: Settings) -> "FailurePolicy":
        return cls(compile_patterns(settings.failure_patterns), settings.node_failure_limit,
                   settings.node_failure_window_seconds)


def drain_if_failing(session: Session, node: Node, policy: FailurePolicy, now: float) -> None:
    """Drains the node when its reports told `node_failure_limit` failures within the window
    that are not of the jobs' own making (an exception, an import error, a configuration)."""
    since = datetime.fromtimestamp(now - policy.node_failure_window_seconds, UTC)
    failures = session.scalars(select(Attempt.diagnosis).where(
        Attempt.failed_node_id == node.id, Attempt.ended_at >= since)).all()  # fmt: skip
    counted = [d for d in failures if d not in JOBS_OWN]
    if len(counted) >= policy.node_failure_limit and node.drained is None:
        node.drained = (f"{len(counted)} failures within {policy.node_failure_window_seconds:g} s "
                        f"({', '.join(sorted(set(map(str, counted))))}): drained until an admin returns it")


def without_logs(cause: str, detail: str, exit_code: int | None) -> Diagnosis:
    """What a failure's cause and exit code alone tell."""
    if cause in CAUSE_DIAGNOSES:
        return Diagnosis(CAUSE_DIAGNOSES[cause], detail[:SUMMARY_CHARS])
    if exit_code == EXIT_CONFIG_ERROR:
        return Diagnosis("configuration", detail[:SUMMARY_CHARS])
    return Diagnosis("signal" if cause == "signal" else "unknown", detail[:SUMMARY_CHARS])


def diagnose(session: Session, attempt: Attempt, cause: str, detail: str, exit_code: int | None,
             patterns: Sequence[tuple[str, re.Pattern[str]]] = DEFAULT_COMPILED) -> Diagnosis:
    """The failure's diagnosis: from the failed rank's last lines when they tell, else its cause."""
    if cause in CAUSE_DIAGNOSES or exit_code == EXIT_CONFIG_ERROR:
        return without_logs(cause, detail, exit_code)
    rank = rank_named(detail)
    if rank is not None:
        text = session.scalar(select(RankLog.text).where(
            RankLog.job_id == attempt.job_id, RankLog.attempt == attempt.number, RankLog.rank == rank))  # fmt: skip
        # The detail last: the agent's word on a kill (the kernel's out-of-memory killer).
        found = read_lines([*(text or "").splitlines()[-TAIL_LINES:], detail], patterns)
        if found is not None:
            return found
    return without_logs(cause, detail, exit_code)


def read_lines(lines: Sequence[str], patterns: Sequence[tuple[str, re.Pattern[str]]]) -> Diagnosis | None:
    for kind, pattern in patterns:
        matched = [line.strip() for line in lines if pattern.search(line)]
        if matched:
            return Diagnosis(kind, matched[-1][:SUMMARY_CHARS])
    return None


def restart_loop(attempts: Sequence[Attempt], newest_checkpoint: str | None, limit: int) -> str | None:
    """Why the job must not restart again, if its last `limit` attempts all failed alike and made
    no progress: the same diagnosis and summary, each resumed from the same checkpoint, and no newer
    one committed since (None: a restart may help)."""
    failed = [a for a in attempts if a.diagnosis is not None][-limit:]
    if len(failed) < limit or len(failed) != len(attempts[-limit:]):
        return None
    first = failed[0]
    if any((a.diagnosis, a.summary, a.resume_from) != (first.diagnosis, first.summary, first.resume_from)
           for a in failed) or newest_checkpoint != first.resume_from:
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
