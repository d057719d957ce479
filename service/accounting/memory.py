"""An in-memory job for the engine: deduplication, step index and checkpoint records in dicts.

The service keeps the same three things in tables; tests, benchmarks and tools use this.
"""

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from service.accounting.engine import TIMING_SOURCE, CheckpointRecord, Event, JobAccount
from service.accounting.fold import fold
from service.accounting.report import build_report
from service.accounting.step_times import step_saving


def _duration(e: Event) -> float:
    return float(e.data.get("duration", 0.0))


class ConflictingEvent(ValueError):
    """An event repeats the key (attempt, source, seq) of a stored one with other content."""


class MemoryJob:
    def __init__(self, job_id: str = "job") -> None:
        self.job_id = job_id
        self.account = JobAccount()
        self.events: dict[tuple[int, str, int], Event] = {}
        self.checkpoints: dict[tuple[int, int], CheckpointRecord] = {}
        self._steps: dict[int, list[tuple[int, float]]] = defaultdict(list)

    def steps_above(self, attempt: int, step: int) -> tuple[int, float]:
        above = [d for s, d in self._steps.get(attempt, ()) if s > step]
        return len(above), sum(above)

    def ingest(self, events: Iterable[Event]) -> tuple[int, int]:
        """Fold a batch; returns (accepted, duplicates). A conflicting repeat rejects the batch
        before anything of it is applied."""
        fresh: dict[tuple[int, str, int], Event] = {}
        duplicates = 0
        for e in events:
            seen = self.events.get(e.key) or fresh.get(e.key)
            if seen is None:
                fresh[e.key] = e
            elif seen == e:
                duplicates += 1
            else:
                raise ConflictingEvent(f"seq {e.seq} of {e.source} in attempt {e.attempt} was sent with other content")
        for e in fresh.values():
            self.events[e.key] = e
            if e.kind == "step" and e.source == TIMING_SOURCE:
                self._steps[e.attempt].append((e.step or 0, _duration(e)))
        fold(self.account, fresh.values(), duration=_duration, event=lambda e: e, record=self._record,
             saving=lambda e: step_saving(e.data))
        self.account.settle(self)
        return len(fresh), duplicates

    def _record(self, e: Event) -> CheckpointRecord:
        key = (e.attempt, e.step or 0)
        return self.checkpoints.setdefault(key, CheckpointRecord(*key))

    def report(
        self, now: float, *, submitted_at: float | None = None, fleet_mtbf_seconds: float | None = None
    ) -> dict[str, Any]:
        state = self.account.finished_state or ("running" if self.account.attempts else "queued")
        return build_report(
            self.account, job_id=self.job_id, state=state, now=now,
            submitted_at=submitted_at, fleet_mtbf_seconds=fleet_mtbf_seconds,
        )  # fmt: skip
