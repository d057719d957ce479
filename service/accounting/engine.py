"""The ETT engine: the accounting table of docs/ett.md as a fold over events.

No database and no HTTP. A job's state (`JobAccount`) is bounded: one `AttemptSummary` per
attempt, whatever the number of steps, so a report costs O(attempts). Every field is folded with
min, max or a sum, so the state does not depend on the order events arrive in. Injected, as they
need more than a summary: the checkpoints (a start paired with its staged/committed by (attempt,
step)), a `CheckpointRecord` each, kept by the caller (a dict here, a table in the service); and
for a rollback discovered late (a restore arriving after the steps it rolls back) an attempt's step
time above a step, from a `StepLookup` (an index here, an indexed SQL SUM in the service), asked by
`JobAccount.settle` only when a rollback point changes. Deduplication on (attempt, source, seq) is
the caller's: `apply` must see each event once. `MemoryJob` bundles all of it for tests and tools.
"""

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ett.protocol import CHECKPOINT_KINDS
from service.accounting.step_times import Verdict, add_steps, copy_windows, judge, new_windows, step_saving

CATEGORIES = ("productive", "wasted", "checkpoint_save", "restore", "init", "recovery", "idle")
TIMING_SOURCE = "rank:0"  # timings come from rank 0; allocation, failure and finish from the service
@dataclass(frozen=True, slots=True)
class Event:
    kind: str
    ts: float
    attempt: int
    source: str
    seq: int
    step: int | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.attempt, self.source, self.seq)


class StepLookup(Protocol):
    def steps_above(self, attempt: int, step: int) -> tuple[int, float]:
        """(count, summed duration) of `attempt`'s step events whose number is above `step`."""
        ...


@dataclass(slots=True)
class CheckpointRecord:
    attempt: int
    step: int
    started_at: float | None = None
    staged_at: float | None = None
    committed_at: float | None = None
    failed_at: float | None = None
    path: str | None = None
    bytes: int | None = None

    def blocking_seconds(self) -> float | None:
        if self.started_at is None or self.staged_at is None:
            return None
        return max(0.0, self.staged_at - self.started_at)

    def commit_seconds(self) -> float | None:
        if self.started_at is None or self.committed_at is None:
            return None
        return max(0.0, self.committed_at - self.started_at)


def _cause_rank(cause: str | None) -> tuple[int, str]:
    return (1 if cause == "exit" else 0, str(cause))


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass
class AttemptSummary:
    attempt: int
    allocated_at: float | None = None
    first_seen_at: float | None = None  # stands in for allocated_at until that event arrives
    nodes: int | None = None  # how many its allocation named (docs/ett.md, "Reduced capacity")
    full_nodes: int | None = None  # an elastic job's full size, where this attempt ran on fewer
    failed_at: float | None = None
    failure_cause: str | None = None
    failure_detail: str | None = None  # the scheduler's one line: "rank 1 exit code 1", ...
    failure_diagnosis: str | None = None  # from the evidence (service/failures/diagnosis.py): exception, ...
    failure_summary: str | None = None  # its line: "ValueError: bad batch", ...
    stopped_at: float | None = None
    last_init_end: float | None = None
    restore_started_at: float | None = None
    restore_ended_at: float | None = None
    restored_step: int | None = None
    first_step_start: float | None = None
    last_step_end: float | None = None
    last_step: int | None = None
    last_staged_at: float | None = None
    steps: int = 0
    step_seconds: float = 0.0
    # Steps above `rolled_back_to` were rolled back by a later attempt (None: nothing was).
    rolled_back_to: int | None = None
    wasted_steps: int = 0
    wasted_seconds: float = 0.0
    blocking_count: int = 0
    blocking_seconds: float = 0.0
    commit_count: int = 0
    commit_seconds: float = 0.0
    committed: int = 0
    last_committed_step: int | None = None
    step_windows: dict[str, Any] = field(default_factory=new_windows)  # slow time's summary (step_times.py)

    @property
    def start(self) -> float | None:
        return self.allocated_at if self.allocated_at is not None else self.first_seen_at

    @property
    def restore_seconds(self) -> float:
        if self.restore_started_at is None or self.restore_ended_at is None:
            return 0.0
        return max(0.0, self.restore_ended_at - self.restore_started_at)

    @property
    def restore_point(self) -> int | None:
        """The step this attempt went back to: its restore, 0 if it stepped without one."""
        if self.restored_step is not None:
            return self.restored_step
        return 0 if self.steps else None

    def rolled_back(self, step: int) -> bool:  # a later attempt went back below its `step` (JobAccount.settle)
        return self.rolled_back_to is not None and step > self.rolled_back_to

    def slow_time(self) -> Verdict:  # its pace, slow time and lasting slowdowns (docs/ett.md, "Slow time")
        return judge(self.step_windows, self.rolled_back_to)

    @property
    def ideal_step_seconds(self) -> float | None:
        return self.slow_time().ideal_step_seconds

    @property
    def slow_seconds(self) -> float:
        return self.slow_time().slow_seconds

    @property
    def last_activity(self) -> float | None:
        """End of the last completed activity (a background commit is not one)."""
        ends = (self.last_step_end, self.last_staged_at, self.restore_ended_at, self.last_init_end)
        return max((t for t in ends if t is not None), default=None)


@dataclass
class JobAccount:
    """The bounded, order-independent state of one job's accounting."""

    attempts: dict[int, AttemptSummary] = field(default_factory=dict)
    finished_at: float | None = None
    finished_state: str | None = None
    last_event_at: float | None = None

    def restored_steps(self) -> dict[int, int]:
        """The step each attempt's ranks went on from (the newer of their local snapshot and the
        checkpoint the scheduler offered), for the attempts that have restored."""
        return {n: a.restored_step for n, a in self.attempts.items() if a.restored_step is not None}

    def attempt(self, number: int) -> AttemptSummary:
        if number not in self.attempts:
            self.attempts[number] = AttemptSummary(number)
        return self.attempts[number]

    def seen(self, attempt: int, first: float, last: float) -> AttemptSummary:
        """Note that the attempt had events from `first` to `last`: all an event of a rank other
        than rank 0 (or of an agent) changes, so a caller may fold many of those at once."""
        a = self.attempt(attempt)
        self.last_event_at = _max(self.last_event_at, last)
        a.first_seen_at = _min(a.first_seen_at, first)
        return a

    def apply(self, e: Event, checkpoint: CheckpointRecord | None = None) -> None:
        """Fold one (new, deduplicated) event. Checkpoint events need their record."""
        a = self.seen(e.attempt, e.ts, e.ts)
        if e.source == "service":
            self._apply_service(a, e)
        elif e.source == TIMING_SOURCE:
            if e.kind in CHECKPOINT_KINDS:
                if checkpoint is None:
                    raise ValueError(f"{e.kind} needs its checkpoint record")
                self._apply_checkpoint(a, e, checkpoint)
            else:
                self._apply_rank0(a, e)

    def apply_steps(self, attempt: int, steps: Sequence[tuple[int, float, float, float]]) -> None:
        """Fold rank 0's (new, deduplicated) step events of one attempt, given as (step, ts,
        duration, saving): the same as `apply` on each, in one pass over the batch."""
        if not steps:
            return
        numbers, ends, durations, savings = zip(*steps)
        last_end = max(ends)
        a = self.seen(attempt, min(ends), last_end)
        a.steps += len(steps)
        a.step_seconds += sum(durations)
        a.first_step_start = _min(a.first_step_start, min(map(operator.sub, ends, durations)))
        a.last_step_end = _max(a.last_step_end, last_end)
        a.last_step = max(a.last_step or 0, max(numbers))
        add_steps(a.step_windows, list(zip(numbers, durations, savings, strict=True)))
        wasted = [d for s, d in zip(numbers, durations, strict=True) if a.rolled_back(s)]
        a.wasted_steps += len(wasted)
        a.wasted_seconds += sum(wasted)

    def _apply_service(self, a: AttemptSummary, e: Event) -> None:
        if e.kind == "attempt_allocated":
            if a.allocated_at is None or e.ts < a.allocated_at:  # the first allocation tells its size
                a.nodes, a.full_nodes = len(e.data.get("nodes") or ()) or None, e.data.get("full_nodes")
            a.allocated_at = _min(a.allocated_at, e.ts)
        elif e.kind == "attempt_failed":
            # The earliest report wins; at the same time the root cause (a signal or hang over a
            # peer's exit, service/jobs/scheduler.py) wins, so any order of arrival agrees.
            key = (e.ts, _cause_rank(e.data.get("cause")))
            if a.failed_at is None or key < (a.failed_at, _cause_rank(a.failure_cause)):
                a.failed_at, a.failure_cause, a.failure_detail = e.ts, e.data.get("cause"), e.data.get("detail")
                a.failure_diagnosis, a.failure_summary = e.data.get("diagnosis"), e.data.get("summary")
        elif e.kind == "attempt_stopped":
            a.stopped_at = _min(a.stopped_at, e.ts)
        elif e.kind == "job_finished" and (self.finished_at is None or e.ts < self.finished_at):
            self.finished_at, self.finished_state = e.ts, e.data.get("state")

    def _apply_rank0(self, a: AttemptSummary, e: Event) -> None:
        if e.kind == "init_end":
            a.last_init_end = _max(a.last_init_end, e.ts)
        elif e.kind == "restore_start":
            a.restore_started_at = _min(a.restore_started_at, e.ts)
        elif e.kind == "restore_end":
            # The last restore is the state training went on from (ties: the older step).
            if a.restore_ended_at is None or (e.ts, -(e.step or 0)) > (a.restore_ended_at, -(a.restored_step or 0)):
                a.restore_ended_at, a.restored_step = e.ts, e.step or 0
        elif e.kind == "step":
            self.apply_steps(e.attempt, [(e.step or 0, e.ts, float(e.data.get("duration", 0.0)), step_saving(e.data))])

    @staticmethod
    def _apply_checkpoint(a: AttemptSummary, e: Event, c: CheckpointRecord) -> None:
        blocking_before, commit_before = c.blocking_seconds(), c.commit_seconds()
        was_committed = c.committed_at is not None
        if e.kind == "ckpt_start":
            c.started_at = _min(c.started_at, e.ts)
        elif e.kind == "ckpt_staged":
            c.staged_at = _min(c.staged_at, e.ts)
            a.last_staged_at = _max(a.last_staged_at, e.ts)
        elif e.kind == "ckpt_committed":
            c.committed_at = _min(c.committed_at, e.ts)
            # A resume point only where the agent found the checkpoint there (agent/checkpoints/checkpoint_check.py).
            c.path = c.path or (e.data.get("path") if e.data.get("verified") is True else None)
            c.bytes = c.bytes if c.bytes is not None else e.data.get("bytes")
        else:
            c.failed_at = _min(c.failed_at, e.ts)
        # A record's contribution to the sums is replaced, so repeats and any order agree.
        for before, after, name in (
            (blocking_before, c.blocking_seconds(), "blocking"),
            (commit_before, c.commit_seconds(), "commit"),
        ):
            if before != after:
                count, seconds = f"{name}_count", f"{name}_seconds"
                setattr(a, count, getattr(a, count) + (after is not None) - (before is not None))
                setattr(a, seconds, getattr(a, seconds) + (after or 0.0) - (before or 0.0))
        if c.committed_at is not None and not was_committed:
            a.committed += 1
            a.last_committed_step = _max(a.last_committed_step, c.step)

    def settle(self, steps: StepLookup) -> None:
        """Bring the rolled-back totals up to date: step s of attempt a is wasted iff a later
        attempt went back to a step below s. Call after each batch of `apply`."""
        rollback: int | None = None  # lowest restore point of the attempts after this one
        for number in sorted(self.attempts, reverse=True):
            a = self.attempts[number]
            if rollback != a.rolled_back_to:
                a.rolled_back_to = rollback
                a.wasted_steps, a.wasted_seconds = (0, 0.0) if rollback is None else steps.steps_above(number, rollback)
            point = a.restore_point
            if point is not None:
                rollback = point if rollback is None else min(rollback, point)

    def to_dict(self) -> dict[str, Any]:
        return {
            "finished_at": self.finished_at,
            "finished_state": self.finished_state,
            "last_event_at": self.last_event_at,
            # Every field of a summary is a number, a string or None: a copy of its __dict__ is
            # what dataclasses.asdict gives, at a tenth of its cost (it runs per job per batch).
            "attempts": [dict(a.__dict__, step_windows=copy_windows(a.step_windows))
                         for _, a in sorted(self.attempts.items())],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobAccount":
        # Today's fields only: an account stored with the former rule's step buckets still loads.
        attempts = {a["attempt"]: AttemptSummary(**{k: v for k, v in a.items() if k in AttemptSummary.__dataclass_fields__})
                    for a in d.get("attempts", [])}
        return cls(attempts, d.get("finished_at"), d.get("finished_state"), d.get("last_event_at"))

