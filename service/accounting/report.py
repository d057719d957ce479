"""A job's ETT report (its fields in docs/ett.md) from its settled `JobAccount`, in O(attempts).

Each attempt owns the span from its allocation to the next attempt's allocation (the last one:
to `job_finished`, or now). Inside it, by the table of docs/ett.md:

    init        allocation -> first step start, less the restore (no step: to the last
                init_end/restore_end if the attempt ended, to now if it is still starting)
    restore     restore_start -> restore_end
    productive  kept steps;  wasted: rolled-back steps (see JobAccount.settle)
    checkpoint  ckpt_start -> ckpt_staged
    recovery    a failed attempt's last completed activity -> the next allocation
                (to now while the job waits for it; nothing once the job has finished)
    idle        the rest of the span

Beside the categories, not one of them: an attempt on n of the job's N nodes books (N - n) / N of
each of its productive seconds as reduced capacity (docs/ett.md, "Reduced capacity").
"""

import math
from dataclasses import asdict, dataclass
from typing import Any

from service.accounting.engine import CATEGORIES, AttemptSummary, JobAccount


@dataclass(frozen=True)
class AttemptSpan:
    summary: AttemptSummary
    start: float
    end: float
    next: AttemptSummary | None
    ongoing: bool  # the job's current attempt, not ended yet


def attempt_spans(account: JobAccount, window_end: float) -> list[AttemptSpan]:
    ordered = [a for _, a in sorted(account.attempts.items()) if a.start is not None]
    spans = []
    for i, a in enumerate(ordered):
        nxt = ordered[i + 1] if i + 1 < len(ordered) else None
        end = nxt.start if nxt is not None else window_end
        ended = nxt is not None or account.finished_at is not None or a.failed_at is not None
        ended = ended or a.stopped_at is not None
        spans.append(AttemptSpan(a, a.start, max(a.start, end), nxt, not ended))
    return spans


@dataclass(frozen=True)
class Piece:
    """A stretch of time [lo, hi) and its seconds by category, spread evenly over it."""

    lo: float
    hi: float
    seconds: dict[str, float]

    def clipped(self, since: float, until: float) -> dict[str, float]:
        lo, hi = max(self.lo, since), min(self.hi, until)
        if hi <= lo or self.hi <= self.lo:
            return {}
        share = 1.0 if (lo, hi) == (self.lo, self.hi) else (hi - lo) / (self.hi - self.lo)
        return {k: v * share for k, v in self.seconds.items()}


def _with_idle(lo: float, hi: float, seconds: dict[str, float]) -> Piece:
    seconds = {k: max(0.0, v) for k, v in seconds.items() if v}
    total, length = sum(seconds.values()), max(0.0, hi - lo)
    if total > length:
        # Timings that overlap (steps timed on one clock, events stamped on another, clock
        # corrections between batches) must not count a second twice: share the piece out.
        seconds = {k: v * length / total for k, v in seconds.items()}
        total = length
    return Piece(lo, hi, seconds | {"idle": seconds.get("idle", 0.0) + length - total})


def attempt_pieces(span: AttemptSpan, job_finished: bool) -> list[Piece]:
    """An attempt's span cut in three: start-up (init, restore), training (steps, saves, idle)
    and the tail after its last activity (recovery if it failed, idle otherwise). Every piece
    is exact; only a window cutting through the training piece spreads it evenly."""
    a, start, end = span.summary, span.start, span.end
    clamp = lambda t: min(max(t, start), end)  # noqa: E731
    if a.first_step_start is not None:
        head_end = clamp(a.first_step_start)
    elif span.ongoing:
        head_end = end
    else:  # ended before its first step: start-up lasted until it was last ready
        head_end = clamp(max((t for t in (a.last_init_end, a.restore_ended_at) if t is not None), default=start))
    restore = a.restore_seconds
    head: list[Piece] = []
    lo, hi = a.restore_started_at, a.restore_ended_at
    if restore and lo is not None and hi is not None and start <= lo and hi <= head_end:
        head = [_with_idle(start, lo, {"init": lo - start}), _with_idle(lo, hi, {"restore": restore}),
                _with_idle(hi, head_end, {"init": head_end - hi})]  # fmt: skip
    else:
        head = [_with_idle(start, head_end, {"init": head_end - start - restore, "restore": restore})]
    tail_start = clamp(max(head_end, a.last_activity or head_end))
    training = {
        "productive": a.step_seconds - a.wasted_seconds,
        "wasted": a.wasted_seconds,
        "checkpoint_save": a.blocking_seconds,
    }
    recovering = a.failed_at is not None and (span.next is not None or not job_finished)
    tail = {"recovery" if recovering else "idle": end - tail_start}
    return [*head, _with_idle(head_end, tail_start, training), _with_idle(tail_start, end, tail)]


def attempt_seconds(span: AttemptSpan, job_finished: bool) -> dict[str, float]:
    """Seconds by category inside one attempt's span."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for piece in attempt_pieces(span, job_finished):
        for k, v in piece.seconds.items():
            seconds[k] += v
    return seconds


def capacity_of(a: AttemptSummary) -> float:
    """The share of the job's full size the attempt ran at: 1 unless its allocation named a larger full size."""
    return min(1.0, a.nodes / a.full_nodes) if a.nodes and a.full_nodes else 1.0


def attempt_sizes(spans: list[AttemptSpan], productive: list[float]) -> list[dict[str, Any]]:
    """Each attempt's size (n of N nodes; None where its allocation named none) and its reduced capacity."""
    return [{"attempt": a.attempt, "nodes": a.nodes, "full_nodes": a.full_nodes or a.nodes,
             "reduced_capacity_seconds": kept * (1.0 - capacity_of(a))}
            for a, kept in zip((s.summary for s in spans), productive, strict=True)]  # fmt: skip


def window_of(account: JobAccount, now: float) -> tuple[float, float] | None:
    starts = [a.start for a in account.attempts.values() if a.start is not None]
    if not starts:
        return None
    start = min(starts)
    if account.finished_at is not None:
        end = account.finished_at
    else:  # a clock slightly ahead must not make the window shorter than its events
        end = max(now, account.last_event_at or now)
    return start, max(start, end)


def failures_of(spans: list[AttemptSpan]) -> list[dict[str, Any]]:
    """Each failed attempt's failure (docs/ett.md, "Failures"): its time to recover runs from the
    end of its last completed step (its last completed activity when it made none) to the first
    step start of the first later attempt that makes a step; its lost steps are the steps rolled
    back when the next attempt starts over (to its restore point, or step 0 when it restores
    nothing). An attempt that died before restoring or stepping tells neither: the first later
    attempt that did says where the model went back to."""
    failures = []
    progress = 0  # the step the model was at when each attempt ended
    for i, span in enumerate(spans):
        a = span.summary
        if a.steps:
            progress = a.last_step or 0
        elif a.restored_step is not None:
            progress = a.restored_step
        if a.failed_at is None:
            continue
        later = [s.summary for s in spans[i + 1 :]]
        stepping = next((b for b in later if b.first_step_start is not None), None)
        ttr = None
        if stepping is not None:
            since = a.last_step_end if a.last_step_end is not None else (a.last_activity or span.start)
            ttr = max(0.0, stepping.first_step_start - since)
        starting_over = next((b for b in later if b.restore_point is not None), None)
        lost = 0
        if starting_over is not None:
            lost = max(0, progress - starting_over.restore_point)
            progress = starting_over.restore_point  # what a later failure loses is counted from there
        failures.append(
            {"attempt": a.attempt, "cause": a.failure_cause, "detail": a.failure_detail,
             "diagnosis": a.failure_diagnosis, "summary": a.failure_summary, "at": a.failed_at,
             "time_to_recover_seconds": ttr, "lost_steps": lost}
        )  # fmt: skip
    return failures


def young_interval(blocking_seconds: float | None, mtbf_seconds: float | None) -> float | None:
    """Young's optimal checkpoint interval: sqrt(2 * checkpoint cost * MTBF)."""
    if blocking_seconds is None or mtbf_seconds is None:
        return None
    return math.sqrt(2.0 * blocking_seconds * mtbf_seconds)


def build_report(
    account: JobAccount,
    *,
    job_id: str,
    state: str,
    now: float,
    submitted_at: float | None = None,
    fleet_mtbf_seconds: float | None = None,
    ended_at: float | None = None,
) -> dict[str, Any]:
    """`ended_at`: when the job ended, if it did (a job cancelled in the queue stops queueing then)."""
    window = window_of(account, now)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    spans: list[AttemptSpan] = []
    productive: list[float] = []  # each span's
    wall = 0.0
    if window is not None:
        wall = window[1] - window[0]
        spans = attempt_spans(account, window[1])
        for span in spans:
            by_category = attempt_seconds(span, account.finished_at is not None)
            productive.append(by_category["productive"])
            for k, v in by_category.items():
                seconds[k] += v
    queue_end = window[0] if window is not None else ended_at if ended_at is not None else now
    failures = failures_of(spans)
    attempts = [s.summary for s in spans]
    first_steps = [a.first_step_start for a in attempts if a.first_step_start is not None]
    blocking_count = sum(a.blocking_count for a in attempts)
    commit_count = sum(a.commit_count for a in attempts)
    mean_blocking = sum(a.blocking_seconds for a in attempts) / blocking_count if blocking_count else None
    mtbf = wall / len(failures) if failures else None
    verdicts = [(a.attempt, a.slow_time()) for a in attempts]
    slow = min(seconds["productive"], sum(v.slow_seconds for _, v in verdicts))
    ideal = next((v.ideal_step_seconds for _, v in reversed(verdicts) if v.ideal_step_seconds is not None), None)
    sizes = attempt_sizes(spans, productive)
    reduced = sum(s["reduced_capacity_seconds"] for s in sizes)
    return {
        "job_id": job_id,
        "state": state,
        "wall_seconds": wall,
        "queued_seconds": max(0.0, queue_end - submitted_at) if submitted_at is not None else 0.0,
        "ett_percent": 100.0 * seconds["productive"] / wall if wall > 0 else 0.0,
        "seconds": seconds,
        # Productive time above each attempt's ideal step (docs/ett.md, "Slow time"), and what was
        # productive at full speed: ETT% less the slow share.
        "slow_seconds": slow,
        "full_speed_percent": 100.0 * (seconds["productive"] - slow) / wall if wall > 0 else 0.0,
        "ideal_step_seconds": ideal,
        # Productive seconds short of the full size, and productive node-seconds over wall x the full
        # size: ETT% less the reduced share (docs/ett.md, "Reduced capacity").
        "reduced_capacity_seconds": reduced,
        "capacity_percent": 100.0 * (seconds["productive"] - reduced) / wall if wall > 0 else 0.0,
        "attempt_sizes": sizes,
        # Lasting changes in an attempt's pace; job_report (accounts.py) says a straggler's or the whole job's.
        "slowdowns": [{"attempt": n, **asdict(s)} for n, v in verdicts for s in v.slowdowns],
        "time_to_start_seconds": min(first_steps) - window[0] if first_steps and window else None,
        "failures": failures,
        "restarts": max(0, len(attempts) - 1),
        "last_step": next((a.last_step for a in reversed(attempts) if a.last_step is not None), None),
        "mtbf_seconds": mtbf,
        "checkpoints": {
            "committed": sum(a.committed for a in attempts),
            "last_committed_step": max(
                (a.last_committed_step for a in attempts if a.last_committed_step is not None), default=None
            ),
            "mean_blocking_seconds": mean_blocking,
            "mean_commit_seconds": sum(a.commit_seconds for a in attempts) / commit_count if commit_count else None,
        },
        "recommended_checkpoint_interval_seconds": young_interval(
            mean_blocking, mtbf if mtbf is not None else fleet_mtbf_seconds
        ),
    }
