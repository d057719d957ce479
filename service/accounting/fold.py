"""The fold of a job's new events into its account: one way, for the service's ingestion
(service/ingest/store.py) and the in-memory job (service/accounting/memory.py).

Most events of a big job are other ranks' and the agents': all they change is their attempt's
first and last times, so those are folded per attempt at once, as are rank 0's steps; the rest
(rank 0's start-up, restores and checkpoints, the service's own) one by one.
"""

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from ett.protocol import CHECKPOINT_KINDS
from service.accounting.engine import (
    TIMING_SOURCE,
    CheckpointRecord,
    Event,
    JobAccount,
)


class Folded(Protocol):
    """What the fold reads of an event (an Event, or a row on its way into the database)."""

    @property
    def kind(self) -> str: ...
    @property
    def ts(self) -> float: ...
    @property
    def attempt(self) -> int: ...
    @property
    def source(self) -> str: ...
    @property
    def step(self) -> int | None: ...


E = TypeVar("E", bound=Folded)


def is_checkpoint(e: Folded) -> bool:
    return e.kind in CHECKPOINT_KINDS and e.source == TIMING_SOURCE


def fold(
    account: JobAccount,
    events: Iterable[E],
    *,
    duration: Callable[[E], float],
    event: Callable[[E], Event],
    record: Callable[[E], CheckpointRecord],
    saving: Callable[[E], float] = lambda _e: 0.0,
) -> None:
    """Applies new (deduplicated) events to the account. `duration`: a step's length; `saving`: the
    seconds of it blocked on a save (service/accounting/step_times.py); `event`:
    the Event of one applied alone; `record`: the checkpoint record a checkpoint event updates.
    The caller settles the account afterwards."""
    steps: dict[int, list[tuple[int, float, float, float]]] = defaultdict(list)  # rank 0's, per attempt
    seen: dict[int, list[float]] = defaultdict(list)  # the other ranks' and the agents' times, per attempt
    others: list[E] = []
    for e in events:
        if e.source == TIMING_SOURCE:
            if e.kind == "step":
                steps[e.attempt].append((e.step or 0, e.ts, duration(e), saving(e)))
            else:
                others.append(e)
        elif e.source == "service":
            others.append(e)
        else:
            seen[e.attempt].append(e.ts)
    for attempt, times in seen.items():
        account.seen(attempt, min(times), max(times))
    for attempt, numbered in steps.items():
        account.apply_steps(attempt, numbered)
    for e in others:
        account.apply(event(e), record(e) if is_checkpoint(e) else None)
