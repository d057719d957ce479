"""Which ranks straggle (docs/reliability.md, "Stragglers"), scored window by window as they arrive.

Every WINDOW steps each rank reports its window's median work, the time before it reached the
step's synchronisation (ett/timing.py; the step's time where it marks none), and its second-
lowest. In a window every rank reported, a rank is slow when both its median and its second-
lowest work exceed its peers' by RELATIVE_LIMIT times *and* by STEP_SHARE of the step: a lag too
small to cost the job that share of its step is left alone, however large its ratio (on a shared
machine a 2 ms mark can read 6 ms), and so is a rank that was slow in a step or two of the five
(another process took its core for a moment). WINDOWS_IN_A_ROW such windows, lasting
MIN_SLOW_SECONDS at least, make it a straggler.

A window costs O(world log world), in numpy: its values sorted once, each rank's peers' median
(the order's median without the rank) is one of three values read off that order, and the slow
ranks are the top of it (comparing every rank with a median of its peers took O(world^2): 0.65 s
a scheduler tick at 2,048 ranks). Each row is put in its window's columns as it is read (O(1)),
so the pass that completes a 16,384-rank window does no Python work per rank. An attempt's score
(AttemptScore) keeps only its pending windows, each rank's current run of slow windows and its
first windows' work, so each window is scored once, when its last rank reports
(bench/straggler_scoring.py).
"""

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

RELATIVE_LIMIT = 1.5
STEP_SHARE = 0.15
WINDOWS_IN_A_ROW = 3  # two flagged a healthy rank under CI's load once; three: by step S + 17 at the latest
LOOKBACK_STEPS = 60  # the windows a fresh score reads (a service start): enough for WINDOWS_IN_A_ROW complete ones
EARLY_WINDOWS = 3  # a rank's own baseline: its median over the attempt's first complete windows but one
# A window still missing more ranks than this when a newer one is complete is passed over unread:
# reading them again is a pass's worth of rows (READ_ROWS, service/stragglers/watch.py), no more.
REREAD_RANKS = 512
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
    baseline_seconds: float | None = None  # the rank's own median work early in the attempt (EARLY_WINDOWS)


def peer_median(ordered: Sequence[float], i: int) -> float:
    """The median of the sorted `ordered` without its element at index i, in O(1)."""
    n = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j if j < i else j + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


class Window:
    """One window's timings, a slot per rank, filled as its rows are read (O(1) a row): scoring it
    once complete is numpy's work on its columns, never a pass of Python over its world of rows
    (that pass, 16,384 Timings at once, made a scoring pass's worst case: BENCHMARKS.md)."""

    __slots__ = ("step", "duration", "value", "steady", "seen", "count", "total_steps")

    def __init__(self, step: int, world: int) -> None:
        self.step = step
        self.duration, self.value, self.steady = np.empty(world), np.empty(world), np.empty(world)
        self.seen = np.zeros(world, bool)
        self.count = 0
        self.total_steps: int | None = None

    def put(self, t: Timing) -> None:
        if not 0 <= t.rank < len(self.seen):
            return  # no rank of this attempt's
        if not self.seen[t.rank]:
            self.seen[t.rank] = True
            self.count += 1
        self.duration[t.rank], self.value[t.rank], self.steady[t.rank] = t.duration, t.value, t.steady
        if t.total_steps and (self.total_steps is None or t.total_steps > self.total_steps):
            self.total_steps = t.total_steps

    def missing(self) -> list[int]:
        return np.flatnonzero(~self.seen).tolist()


def _slow_by(values: np.ndarray, step_seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """Which `values` are slow against their peers' median (a mask), and the peers' median of each
    slow one. A value's peers' median is one of three read off the sorted order (peer_median): a
    value above the middle has the lower one, below it the upper one. The slow values are the top
    of the order down to the first that is not: a lower value's peers' median is no lower, and
    equal values are slow alike (without either, the peers are the same)."""
    n = len(values)
    slow, peers = np.zeros(n, bool), np.full(n, np.nan)
    if n < 2:
        return slow, peers
    ordered = np.sort(values)
    middle = (n - 1) // 2
    at = np.where(np.arange(n) > middle, peer_median(ordered, n - 1), peer_median(ordered, 0))
    at[middle] = peer_median(ordered, middle)
    not_slow = np.flatnonzero((ordered - at < STEP_SHARE * step_seconds) | (ordered < RELATIVE_LIMIT * at))
    cut = int(not_slow[-1]) + 1 if len(not_slow) else 0
    if cut < n:
        slow = values >= ordered[cut]
        peers[slow] = at[np.searchsorted(ordered, values[slow], side="left")]
    return slow, peers


def _median(values: np.ndarray) -> float:
    # np.median imports numpy.ma on its first call: 170 ms in the pass that scored the first window.
    ordered, n = np.sort(values), len(values)
    return float((ordered[(n - 1) // 2] + ordered[n // 2]) / 2) if n else 0.0


def slow_in_window(window: Sequence[Timing]) -> list[Straggler]:
    """The ranks slow in one window every rank reported (one Timing each)."""
    columns = Window(window[0].step if window else 0, 1 + max((t.rank for t in window), default=-1))
    for t in window:
        columns.put(t)
    return slow_in(columns)


def slow_in(window: Window) -> list[Straggler]:
    """The ranks slow in a window, from its columns: O(world log world), in numpy."""
    ranks = np.flatnonzero(window.seen)
    duration, value, steady = (column[ranks] for column in (window.duration, window.value, window.steady))
    step_seconds = _median(duration)
    by_value, peers = _slow_by(value, step_seconds)
    if not by_value.any():
        return []
    by_steady, _ = _slow_by(steady, step_seconds)
    found = []
    for i in np.flatnonzero(by_value & by_steady).tolist():
        mine, theirs = float(value[i]), float(peers[i])
        relative = mine / theirs if theirs > 0 else float("inf")
        found.append(Straggler(int(ranks[i]), window.step, window.step, relative, mine, theirs, step_seconds,
                               window.total_steps))
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
    window already scored is passed over). `from_start`: fed from the attempt's first window, so it
    knows each rank's early work (its baseline)."""

    def __init__(self, world: int, from_start: bool = True) -> None:
        self.world = world
        self.done_step: int | None = None  # the newest window scored
        self.pending: dict[int, Window] = {}  # step -> its window, until all ranks reported
        self.runs: dict[int, Run] = {}
        self.early: list[np.ndarray] | None = [] if from_start else None  # the first complete windows' work

    def add(self, timings: Iterable[Timing], reread: Callable[[int, list[int]], Iterable[Timing]] | None = None
            ) -> list[Straggler]:
        """Folds new windows in; the ranks that became stragglers in the windows they complete (each
        once a run of slow windows). A window still incomplete when a newer one completes has its
        missing ranks read again by `reread(step, ranks)`, where given and at most REREAD_RANKS of
        them (a row another writer committed late), and is scored if complete, else passed over,
        as its missing ranks moved on."""
        for t in timings:
            if self.done_step is None or t.step > self.done_step:
                window = self.pending.get(t.step)
                if window is None:
                    window = self.pending[t.step] = Window(t.step, self.world)
                window.put(t)
        found: list[Straggler] = []
        while complete := [s for s, w in self.pending.items() if w.count >= self.world]:
            newest = min(complete)
            for step in sorted(s for s in self.pending if s <= newest):
                window = self.pending.pop(step)
                if step < newest and reread is not None and len(missing := window.missing()) <= REREAD_RANKS:
                    for t in reread(step, missing):
                        window.put(t)
                if window.count >= self.world:
                    self.done_step = step
                    found += self._score(window)
        if self.pending:  # a rank gone quiet: keep a bounded backlog
            for stale in [s for s in self.pending if s <= max(self.pending) - LOOKBACK_STEPS]:
                del self.pending[stale]
        return found

    def baseline(self, rank: int) -> float | None:
        """The rank's median work over the attempt's first complete windows but one, where known."""
        if not self.early or len(self.early) < 2:
            return None
        return statistics.median(float(window[rank]) for window in self.early[1:])

    def _score(self, window: Window) -> list[Straggler]:
        if self.early is not None and len(self.early) <= EARLY_WINDOWS:
            self.early.append(window.value)
        slow = slow_in(window) if self.world >= 2 else []
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
                became.append(replace(s, baseline_seconds=self.baseline(s.rank)))
        return became

    def current(self) -> list[Straggler]:
        """The ranks slow in each of the newest windows, enough of them to be stragglers."""
        return sorted((s for run in self.runs.values() if (s := run.straggler()) is not None), key=lambda s: s.rank)


def find_stragglers(timings: Sequence[Timing], world: int) -> list[Straggler]:
    """The ranks slow in each of the newest WINDOWS_IN_A_ROW complete windows (and since when)."""
    score = AttemptScore(world)
    score.add(timings)
    return score.current()
