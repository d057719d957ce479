"""Slow time (docs/ett.md, "Slow time"): the part of an attempt's kept steps beyond the job's own
pace and noise, and a slowdown of the whole job found against its own history.

An attempt's step times are kept in windows of WINDOW_STEPS consecutive step numbers (twice as
wide, merged in pairs, each time the attempt outgrows MAX_WINDOWS): each window's steps, seconds
and squared seconds; beside them its first WARMUP_STEPS steps, the seconds its steps spent blocked
on a save (a step event's `saving`), and the stride of its step numbers (their greatest common
difference: a script that counts micro-batches numbers its steps 4 apart; windows are then judged
merged so that each spans WINDOW_STEPS steps). All of it is sums, a lowest-N set, a gcd and a
min/max, so it is bounded and the same in whatever order the events arrive (JSON, see
`new_windows`). `judge` applies the rule to it:

1. leave out warm-up (the attempt's first WARMUP_STEPS steps: it restores, if at all, before
   them), windows with steps a later attempt rolled back (wasted, not slow), and windows holding
   under MIN_FILL of their steps (too few to tell);
2. the noise of a window's mean: the median over the windows of their steps' standard error, as a
   share of the window's mean (so a slow window's larger spread does not widen it); the band:
   BAND_SIGMAS of that share, and at least BAND_FLOOR, of the pace;
3. the pace (the ideal step): the mean step of the windows within the band of the lower quartile
   of the windows' means. Google's goodput takes the mean of the steps under median + 3 MAD; a
   window's mean, not a step, so a job's own every-Nth-step work is part of its pace, and a
   quartile, not the median, so an attempt slow for most of its windows still shows its pace;
4. a window whose mean, less the time its steps spent blocked on saves (booked already as
   checkpoint time), is above pace + band is slow: what it took above the pace, less that, is slow time;
5. LASTING_WINDOWS slow windows in a row after a steady one: a lasting slowdown (its since step,
   its factor over the pace), which the report tells apart from a straggler.
"""

import heapq
import math
from math import gcd
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

WINDOW_STEPS = 10  # a job's every-10th-step work (an eval, a log) falls once in each window
MAX_WINDOWS = 128  # an attempt's windows at most (about 5 KB of JSON): a longer one gets wider windows
WARMUP_STEPS = 5  # an attempt's first steps compile, fill caches, warm the loader: left out
MIN_FILL = 0.5  # a window holding fewer of its steps tells nothing
MIN_WINDOWS = 3  # fewer windows tell no pace: no slow time
STEADY_QUANTILE = 0.25  # the pace is found around the lower quartile of the windows' means
BAND_SIGMAS = 4.0  # a window's mean is slow beyond 4 standard errors of the job's own noise...
BAND_FLOOR = 0.05  # ...and beyond 5% of the pace
LASTING_WINDOWS = 3  # this many slow windows in a row, after a steady one: a lasting slowdown


def step_saving(data: dict[str, Any]) -> float:
    """The seconds a step event says its step spent blocked on a save (`saving`; 0 when absent)."""
    saving = data.get("saving")
    return float(saving) if isinstance(saving, (int, float)) and 0 < saving < math.inf else 0.0


def new_windows() -> dict[str, Any]:
    """An attempt's step-time summary: window width, first and last step, windows (index ->
    [steps, seconds, squared seconds]), the earliest steps ([step, seconds]), saves (index -> blocking)."""
    return {"width": WINDOW_STEPS, "first": None, "last": None, "windows": {}, "early": [], "saves": {}}


def copy_windows(w: dict[str, Any]) -> dict[str, Any]:
    return dict(w, windows={k: list(v) for k, v in w["windows"].items()}, early=[list(p) for p in w["early"]],
                saves=dict(w["saves"]))


def add_steps(w: dict[str, Any], steps: Sequence[tuple[int, float] | tuple[int, float, float]]) -> None:
    """Fold (step, seconds) or (step, seconds, seconds blocked on a save inside it), each step once."""
    if not steps:
        return
    numbers = [s[0] for s in steps]
    # The stride: the gcd of the differences to any one step of the attempt is that of all of them.
    ref = w.setdefault("ref", numbers[0])
    w["stride"] = gcd(w.get("stride", 0), *(abs(n - ref) for n in numbers))
    w["first"] = min(numbers) if w["first"] is None else min(w["first"], *numbers)
    w["last"] = max(numbers) if w["last"] is None else max(w["last"], *numbers)
    _widen(w)
    width, windows = w["width"], w["windows"]
    for step, seconds, *saving in steps:
        key = str(step // width)
        cell = windows.setdefault(key, [0, 0.0, 0.0])
        cell[0] += 1
        cell[1] += seconds
        cell[2] += seconds * seconds
        if saving and saving[0] > 0:  # booked as checkpoint time already: never again as slow
            w["saves"][key] = w["saves"].get(key, 0.0) + saving[0]
    pairs = [(s[0], s[1]) for s in steps]
    w["early"] = [list(p) for p in heapq.nsmallest(WARMUP_STEPS, [*map(tuple, w["early"]), *pairs])]


def _widen(w: dict[str, Any]) -> None:
    """The width the attempt's span of steps needs (a function of first and last alone, so the
    same whatever the order); windows and saves regrouped exactly (the widths are 10 x 2^k)."""
    old = width = w["width"]
    while w["last"] // width - w["first"] // width >= MAX_WINDOWS:
        width *= 2
    if width == old:
        return
    windows: dict[str, list[float]] = {}
    for key, (n, s, ss) in w["windows"].items():
        cell = windows.setdefault(str(int(key) * old // width), [0, 0.0, 0.0])
        cell[0], cell[1], cell[2] = cell[0] + n, cell[1] + s, cell[2] + ss
    saves: dict[str, float] = {}
    for key, seconds in w["saves"].items():
        merged = str(int(key) * old // width)
        saves[merged] = saves.get(merged, 0.0) + seconds
    w["width"], w["windows"], w["saves"] = width, windows, saves


@dataclass(frozen=True)
class Window:
    index: int
    steps: int
    seconds: float  # less its saves' blocking
    error: float  # the standard error of its mean step, as a share of it
    saved: bool  # a save's blocking fell in it

    @property
    def mean(self) -> float:
        return self.seconds / self.steps


@dataclass(frozen=True)
class Slowdown:
    since_step: int
    last_step: int
    ongoing: bool  # it lasts to the attempt's newest window
    step_seconds: float
    factor: float  # its mean step over the pace
    slow_seconds: float


@dataclass(frozen=True)
class Verdict:
    ideal_step_seconds: float | None  # the pace; None: too few windows to tell
    band_seconds: float  # what a window's mean may exceed the pace by and not be slow
    slow_seconds: float
    slowdowns: tuple[Slowdown, ...]


NO_VERDICT = Verdict(None, 0.0, 0.0, ())


def judged_width(w: dict[str, Any]) -> tuple[int, int]:
    """The width of the windows as judged, and how many stored ones each merges: steps numbered
    `stride` apart are judged in windows spanning WINDOW_STEPS of them (merged in powers of two)."""
    merge = 1
    while merge < (w.get("stride") or 1):
        merge *= 2
    return w["width"] * merge, merge


def windows_of(w: dict[str, Any], rolled_back_to: int | None = None) -> list[Window]:
    """The attempt's windows that tell (rule 1), oldest first; their index in judged_width's units."""
    width, merge = judged_width(w)
    cells: dict[int, list[float]] = {}
    for key, (n, s, ss) in w["windows"].items():
        cell = cells.setdefault(int(key) // merge, [0, 0.0, 0.0])
        cell[0], cell[1], cell[2] = cell[0] + n, cell[1] + s, cell[2] + ss
    saves: dict[int, float] = {}
    for key, seconds in w["saves"].items():
        saves[int(key) // merge] = saves.get(int(key) // merge, 0.0) + seconds
    for step, seconds in w["early"]:
        cell = cells.get(int(step) // width)
        if cell is not None:
            cell[0], cell[1], cell[2] = cell[0] - 1, cell[1] - seconds, cell[2] - seconds * seconds
    cut = None if rolled_back_to is None else (rolled_back_to + 1) // width  # from it on: rolled back
    expected = width / (w.get("stride") or 1)  # steps a full window holds
    found = []
    for index, (n, s, ss) in sorted(cells.items()):
        n = round(n)
        if n < max(2, MIN_FILL * expected) or (cut is not None and index >= cut):
            continue
        variance = max(0.0, (ss - s * s / n) / (n - 1))
        save = max(0.0, saves.get(index, 0.0))
        error = math.sqrt(variance / n) / (s / n) if s > 0 else 0.0
        found.append(Window(index, n, max(0.0, s - save), error, save > 0))
    return found


def judge(w: dict[str, Any], rolled_back_to: int | None = None) -> Verdict:
    """The rule (module docstring) on an attempt's summary."""
    rows = windows_of(w, rolled_back_to)
    plain = [r for r in rows if not r.saved]
    stats = plain if len(plain) >= MIN_WINDOWS else rows  # saves in every window: judged with them
    if len(stats) < MIN_WINDOWS:
        return NO_VERDICT
    noise = statistics.median(r.error for r in stats)
    means = sorted(r.mean for r in stats)
    quartile = means[int(STEADY_QUANTILE * (len(means) - 1))]
    share = max(BAND_SIGMAS * noise, BAND_FLOOR)
    steady = [r for r in stats if abs(r.mean - quartile) <= share * quartile]
    pace = sum(r.seconds for r in steady) / sum(r.steps for r in steady)
    if pace <= 0:
        return NO_VERDICT  # steps of no length (or all blocking): nothing to be slower than
    band = share * pace
    slow = [r.mean > pace + band for r in rows]
    booked = [r.seconds - r.steps * pace if s else 0.0 for r, s in zip(rows, slow, strict=True)]
    return Verdict(pace, band, sum(booked), tuple(_lasting(w, rows, slow, booked, pace)))


def _lasting(w: dict[str, Any], rows: list[Window], slow: list[bool], booked: list[float], pace: float
             ) -> list[Slowdown]:
    """Rule 5: the runs of LASTING_WINDOWS or more slow windows that follow a steady one."""
    found, start, width = [], None, judged_width(w)[0]
    for i in range(len(rows) + 1):
        if i < len(rows) and slow[i]:
            start = i if start is None else start
            continue
        if start is not None and start > 0 and i - start >= LASTING_WINDOWS:
            run = rows[start:i]
            steps, seconds = sum(r.steps for r in run), sum(r.seconds for r in run)
            found.append(Slowdown(
                since_step=max(run[0].index * width, w["first"]), last_step=min(run[-1].index * width + width - 1,
                                                                                w["last"]),
                ongoing=i == len(rows), step_seconds=seconds / steps, factor=seconds / steps / pace,
                slow_seconds=sum(booked[start:i]),
            ))  # fmt: skip
        start = None
    return found
