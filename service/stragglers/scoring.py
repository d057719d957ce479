"""Which ranks straggle (docs/reliability.md, "Stragglers"), scored window by window as they arrive.

Every WINDOW steps each rank reports its window's median work, the time before it reached the
step's synchronisation (ett/timing.py; the step's time where it marks none), and its second-
lowest. In a window every rank reported, a rank is slow when both its median and its second-
lowest work exceed its peers' by RELATIVE_LIMIT times *and* by STEP_SHARE of the step: a lag too
small to cost the job that share of its step is left alone, however large its ratio (on a shared
machine a 2 ms mark can read 6 ms), and so is a rank that was slow in a step or two of the five
(another process took its core for a moment). WINDOWS_IN_A_ROW such windows, lasting
MIN_SLOW_SECONDS at least, make it a straggler.

A window costs O(world log world): its values sorted once, each rank's peers' median is the
median of that order without the rank, read in O(1), and only the ranks above the median can
be slow, so the scan stops at the first one that is not (comparing every rank with a median of
its peers took O(world^2): 0.65 s a scheduler tick at 2,048 ranks). An attempt's score
(AttemptScore) keeps only its pending windows and each rank's current run of slow windows, so
each window is scored once, when its last rank reports (bench/straggler_scoring.py).
"""

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

RELATIVE_LIMIT = 1.5
STEP_SHARE = 0.15
WINDOWS_IN_A_ROW = 3  # two flagged a healthy rank under CI's load once; three: by step S + 17 at the latest
LOOKBACK_STEPS = 60  # the windows a fresh score reads (a service start): enough for WINDOWS_IN_A_ROW complete ones
# A slowdown shorter than this is the machine's scheduling noise, not a straggler: a healthy rank of
# a job of 50 ms steps, starved of its core for 0.8 s on a shared 2-core machine, was flagged (CI,
# 2026-11-27). Steps of a real job last far longer: three windows of them pass this at once.
MIN_SLOW_SECONDS = 1.5


@dataclass(frozen=True, slots=True)
class Timing:
    """One rank's window: its last step, median step time and median work (None: not marked)."""

    rank: int
    step: int
    duration: float
    work: float | None
    total_steps: int | None = None
    work_low: float | None = None  # the window's second-lowest work

    @property
    def value(self) -> float:
        return self.work if self.work is not None else self.duration

    @property
    def steady(self) -> float:
        """What is compared: the second-lowest work, which hiccups leave alone, where known."""
        return self.work_low if self.work_low is not None else self.value


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    since_step: int
    flagged_step: int
    relative: float
    work_seconds: float
    peer_seconds: float
    step_seconds: float  # the window's median step time
    total_steps: int | None = None  # the job's steps, as its ranks report them


def peer_median(ordered: Sequence[float], i: int) -> float:
    """The median of the sorted `ordered` without its element at index i, in O(1)."""
    n = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j if j < i else j + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _slow_by(ranks: np.ndarray, values: np.ndarray, step_seconds: float) -> dict[int, float]:
    """The ranks slow by `values` against their peers' median, with that median. Scanned from the
    top of the order down: a lower value's peers' median is no lower, so the first index that is
    not slow ends the scan, and equal values are slow alike (without either, the peers are the same)."""
    ordered = np.sort(values).tolist()
    cut = len(ordered)
    while cut > 0:
        peer = peer_median(ordered, cut - 1)
        if ordered[cut - 1] - peer < STEP_SHARE * step_seconds or ordered[cut - 1] < RELATIVE_LIMIT * peer:
            break
        cut -= 1
    if cut == len(ordered):
        return {}
    slow = values >= ordered[cut]
    return {rank: peer_median(ordered, bisect.bisect_left(ordered, value))
            for rank, value in zip(ranks[slow].tolist(), values[slow].tolist(), strict=True)}


def slow_in_window(window: Sequence[Timing]) -> list[Straggler]:
    """The ranks slow in one window every rank reported (one Timing each)."""
    n = len(window)
    step_seconds = float(np.median(np.fromiter((t.duration for t in window), float, n)))
    ranks = np.fromiter((t.rank for t in window), np.int64, n)
    values = np.fromiter((t.value for t in window), float, n)
    by_value = _slow_by(ranks, values, step_seconds)
    if not by_value:
        return []
    by_steady = _slow_by(ranks, np.fromiter((t.steady for t in window), float, n), step_seconds)
    total = max((t.total_steps for t in window if t.total_steps), default=None)
    found = []
    for t in window:
        if t.rank in by_value and t.rank in by_steady:
            peers = by_value[t.rank]
            relative = t.value / peers if peers > 0 else float("inf")
            found.append(Straggler(t.rank, t.step, t.step, relative, t.value, peers, step_seconds, total))
    return found


@dataclass(slots=True)
class Run:
    """A rank's slow windows in a row, up to the newest complete one."""

    since_step: int
    newest: Straggler
    windows: int
    step_seconds: float  # the windows' median step times, summed
    told: bool = False  # found a straggler, and said so

    def lasted(self) -> float:
        """About how long it lasted: its steps times their step time."""
        if self.windows < 2:
            return 0.0
        steps_per_window = (self.newest.flagged_step - self.since_step) / (self.windows - 1)
        return steps_per_window * self.step_seconds

    def straggler(self) -> Straggler | None:
        if self.windows < WINDOWS_IN_A_ROW or self.lasted() < MIN_SLOW_SECONDS:
            return None
        n = self.newest
        return Straggler(n.rank, self.since_step, n.flagged_step, n.relative, n.work_seconds, n.peer_seconds,
                         n.step_seconds, n.total_steps)


class AttemptScore:
    """One attempt's straggler score, fed its ranks' windows as they arrive (each once or more: a
    window already scored is passed over)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.done_step: int | None = None  # the newest window scored
        self.pending: dict[int, dict[int, Timing]] = {}  # step -> rank -> its window, until all reported
        self.runs: dict[int, Run] = {}

    def add(self, timings: Iterable[Timing], reread: Callable[[int], Iterable[Timing]] | None = None
            ) -> list[Straggler]:
        """Folds new windows in; the ranks that became stragglers in the windows they complete (each
        once a run of slow windows). A window still incomplete when a newer one completes is read
        again whole by `reread(step)`, where given (a row another writer committed late), and
        scored if complete, else passed over, as its missing rank moved on."""
        for t in timings:
            if self.done_step is None or t.step > self.done_step:
                self.pending.setdefault(t.step, {})[t.rank] = t
        found: list[Straggler] = []
        while complete := [s for s, w in self.pending.items() if len(w) >= self.world]:
            newest = min(complete)
            for step in sorted(s for s in self.pending if s <= newest):
                window = self.pending.pop(step)
                if step < newest and reread is not None:
                    window.update((t.rank, t) for t in reread(step))
                if len(window) >= self.world:
                    self.done_step = step
                    found += self._score(list(window.values()))
        if self.pending:  # a rank gone quiet: keep a bounded backlog
            for stale in [s for s in self.pending if s <= max(self.pending) - LOOKBACK_STEPS]:
                del self.pending[stale]
        return found

    def _score(self, window: list[Timing]) -> list[Straggler]:
        slow = slow_in_window(window) if self.world >= 2 else []
        runs = {}
        for s in slow:
            run = self.runs.get(s.rank)
            if run is None:
                runs[s.rank] = Run(s.since_step, s, 1, s.step_seconds)
            else:
                run.newest, run.windows, run.step_seconds = s, run.windows + 1, run.step_seconds + s.step_seconds
                runs[s.rank] = run
        self.runs = runs  # a rank not slow in this window starts over
        became = []
        for run in runs.values():
            if not run.told and (s := run.straggler()) is not None:
                run.told = True  # once a run: a rank slow for hours is not told every window
                became.append(s)
        return became

    def current(self) -> list[Straggler]:
        """The ranks slow in each of the newest windows, enough of them to be stragglers."""
        return sorted((s for run in self.runs.values() if (s := run.straggler()) is not None), key=lambda s: s.rank)


def find_stragglers(timings: Sequence[Timing], world: int) -> list[Straggler]:
    """The ranks slow in each of the newest WINDOWS_IN_A_ROW complete windows (and since when)."""
    score = AttemptScore(world)
    score.add(timings)
    return score.current()
