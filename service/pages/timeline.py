"""The job page's timeline: one lane per attempt, its time cut into ETT categories and drawn as
runs of pixel columns, so a lane costs at most `columns` SVG elements whatever its step count.

The lanes' bounds, their start-up (init, restore) and their tail (recovery or idle) are the
report's own pieces (service/accounting/report.py); only the inside of an attempt's training stretch is
laid out here, from its step time (summed per column by the database: timeline_data.py)
and its checkpoint saves. Each column of a lane takes the category that fills most of it, and
neighbouring columns of one category become one run.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.accounting.engine import CATEGORIES, JobAccount
from service.accounting.report import (
    Piece,
    attempt_pieces,
    attempt_spans,
    failures_of,
    window_of,
)

IDLE = CATEGORIES.index("idle")


@dataclass(frozen=True)
class Frame:
    """The drawing's time axis: the job's window cut into `columns` equal columns."""

    start: float
    end: float
    columns: int

    @property
    def column_seconds(self) -> float:
        return max(self.end - self.start, 1e-9) / self.columns


def frame_of(account: JobAccount, now: float, columns: int = 1000) -> Frame | None:
    """None before the job's first allocation: nothing to draw."""
    window = window_of(account, now)
    return None if window is None else Frame(window[0], window[1], columns)


@dataclass(frozen=True)
class StepTime:
    """Stretches of step time, one array each: [start, start + seconds) of an attempt, kept or not."""

    attempt: np.ndarray
    wasted: np.ndarray  # bool
    start: np.ndarray
    seconds: np.ndarray

    @classmethod
    def from_rows(cls, rows: list[tuple[int, bool, float, float]]) -> "StepTime":
        columns = list(zip(*rows)) if rows else [(), (), (), ()]
        return cls(*(np.asarray(c, dtype=t) for c, t in zip(columns, (int, bool, float, float), strict=True)))


@dataclass(frozen=True)
class SaveSpan:
    attempt: int
    started_at: float
    staged_at: float


@dataclass(frozen=True)
class Run:
    """Columns [first, last) of a lane drawn in one category."""

    category: str
    first: int
    last: int
    start: float  # unix seconds of its first column's left edge
    end: float


@dataclass(frozen=True)
class Lane:
    attempt: int
    runs: list[Run]
    failure: dict[str, Any] | None  # the report's entry for this attempt's failure
    failure_column: float | None


@dataclass(frozen=True)
class Timeline:
    frame: Frame
    lanes: list[Lane]

    @property
    def columns(self) -> int:
        return self.frame.columns

    def ticks(self, most: int = 8) -> list[tuple[float, str]]:
        """Axis marks at round durations since the window's start: (column, label)."""
        width = self.frame.end - self.frame.start
        if width <= 0:
            return [(0.0, "0 s")]
        day = _TICK_STEPS[-1]
        step = next((s for s in _TICK_STEPS if width / s <= most), day * math.ceil(width / day / most))
        return [(i * step / width * self.columns, _duration_label(i * step)) for i in range(int(width // step) + 1)]


_TICK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200, 86400)


def _duration_label(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:g} s"
    if seconds < 3600:
        return f"{seconds / 60:g} min"
    return f"{seconds / 3600:g} h"


class _Intervals:
    """[lo, hi) intervals by category, in seconds since the window's start."""

    def __init__(self) -> None:
        self.by_category: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}

    def add(self, category: str, lo: float | np.ndarray, hi: float | np.ndarray) -> None:
        los, his = self.by_category.setdefault(CATEGORIES.index(category), ([], []))
        los.append(np.atleast_1d(lo))
        his.append(np.atleast_1d(hi))

    def arrays(self) -> Iterable[tuple[int, np.ndarray, np.ndarray]]:
        for category, (los, his) in self.by_category.items():
            lo, hi = np.concatenate(los), np.concatenate(his)
            kept = hi > lo
            yield category, lo[kept], hi[kept]

    def lay_out(self, piece: Piece, origin: float) -> None:
        """A piece whose layout inside is not known: its categories one after the other."""
        t = piece.lo - origin
        for category, seconds in piece.seconds.items():
            if category != "idle":
                self.add(category, t, t + seconds)
                t += seconds


def _covered(xs: np.ndarray, t: np.ndarray) -> np.ndarray:
    """sum over i of max(0, t - xs[i]), for each t."""
    xs = np.sort(xs)
    below = np.searchsorted(xs, t, side="right")
    prefix = np.concatenate(([0.0], np.cumsum(xs)))
    return below * t - prefix[below]


def _rasterize(intervals: _Intervals, lo: float, hi: float, edges: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs (category, first column, last column) of a lane spanning [lo, hi)."""
    cover = np.zeros((len(CATEGORIES), len(edges) - 1))
    for category, los, his in intervals.arrays():
        # Time of the category before t is sum max(0, t - lo) - sum max(0, t - hi): any overlap is fine.
        cover[category] = np.diff(_covered(los, edges) - _covered(his, edges))
    inside = np.clip(np.minimum(edges[1:], hi) - np.maximum(edges[:-1], lo), 0.0, None)
    cover[IDLE] += np.clip(inside - cover.sum(axis=0), 0.0, None)
    dominant = cover.argmax(axis=0)
    runs: list[tuple[int, int, int]] = []
    for column in np.flatnonzero(inside > 0):
        category = int(dominant[column])
        if runs and runs[-1][0] == category and runs[-1][2] == column:
            runs[-1] = (category, runs[-1][1], column + 1)
        else:
            runs.append((category, int(column), int(column) + 1))
    return runs


def build_timeline(account: JobAccount, frame: Frame, steps: StepTime, saves: Iterable[SaveSpan]) -> Timeline:
    """The timeline of a job's settled account, with its step time and saves."""
    origin, columns = frame.start, frame.columns
    edges = np.arange(columns + 1) * frame.column_seconds  # seconds since the window's start
    spans = attempt_spans(account, frame.end)
    finished = account.finished_at is not None
    intervals = {s.summary.attempt: _Intervals() for s in spans}
    training: dict[int, Piece] = {}
    for span in spans:
        *head, middle, tail = attempt_pieces(span, finished)
        for piece in (*head, tail):
            intervals[span.summary.attempt].lay_out(piece, origin)
        training[span.summary.attempt] = middle
    for number, middle in training.items():
        mine = steps.attempt == number
        # A column's summed time starts at the column's edge: kept inside the training stretch.
        lo = np.clip(steps.start[mine], middle.lo, middle.hi)
        hi = np.minimum(lo + steps.seconds[mine], middle.hi)
        wasted = steps.wasted[mine]
        intervals[number].add("productive", lo[~wasted] - origin, hi[~wasted] - origin)
        intervals[number].add("wasted", lo[wasted] - origin, hi[wasted] - origin)
    for c in saves:
        middle = training.get(c.attempt)
        if middle is not None:
            lo, hi = max(c.started_at, middle.lo), min(c.staged_at, middle.hi)
            intervals[c.attempt].add("checkpoint_save", lo - origin, hi - origin)
    failures = {f["attempt"]: f for f in failures_of(spans)}
    lanes = []
    for span in spans:
        number = span.summary.attempt
        raster = _rasterize(intervals[number], span.start - origin, span.end - origin, edges)
        runs = [Run(CATEGORIES[c], a, b, origin + edges[a], origin + edges[b]) for c, a, b in raster]
        failure = failures.get(number)
        mark = min(max(failure["at"] - origin, 0.0), edges[-1]) / frame.column_seconds if failure else None
        lanes.append(Lane(number, runs, failure, mark))
    return Timeline(frame, lanes)
