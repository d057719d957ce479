"""The job page's chart of loss and step time across attempts, each attempt's size beside it.

Drawn by the server as SVG polylines (templates/steps.svg.html), like the timeline: one line per
attempt and stretch of kept or rolled-back steps, over the points the database averaged per band
of step numbers (service/accounting/steps.py), so the drawing stays small at a million steps.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from service.accounting.steps import CurvePoint

WIDTH, PANEL = 1000.0, 120.0  # the plot's width and each panel's height, in viewBox units


@dataclass(frozen=True)
class Series:
    attempt: int
    rolled_back: bool
    loss: str  # SVG points "x,y x,y ..." in the loss panel ("" where the script sent no loss)
    seconds: str  # ... in the step time panel


@dataclass(frozen=True)
class Size:
    attempt: int
    nodes: int | None
    full_nodes: int | None

    @property
    def reduced(self) -> bool:
        return bool(self.nodes and self.full_nodes and self.nodes < self.full_nodes)

    @property
    def label(self) -> str:
        size = f"{self.nodes} of {self.full_nodes} nodes" if self.nodes else "nodes unknown"
        return f"attempt {self.attempt}: {size}"


@dataclass(frozen=True)
class StepChart:
    series: list[Series]
    sizes: list[Size]
    steps: tuple[int, int]  # the first and last step drawn
    loss: tuple[float, float] | None  # the loss axis' range (None: no loss sent)
    seconds: tuple[float, float]


def _scale(lo: float, hi: float, size: float, flip: bool) -> Callable[[float], float]:
    span = (hi - lo) or 1.0
    return (lambda v: size - (v - lo) / span * size) if flip else (lambda v: (v - lo) / span * size)


def _points(xs: Iterable[float], ys: Iterable[float]) -> str:
    pairs = [f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True)]
    if len(pairs) == 1:  # one point draws nothing as a line: a short dash instead
        x, y = pairs[0].split(",")
        pairs.append(f"{float(x) + 2:.1f},{y}")
    return " ".join(pairs)


def build_step_chart(curve: list[CurvePoint], sizes: list[dict[str, Any]]) -> StepChart | None:
    """The chart of the curve's points; `sizes`: the report's `attempt_sizes`. None without a step."""
    if not curve:
        return None
    first, last = min(p.first_step for p in curve), max(p.last_step for p in curve)
    losses = [p.loss for p in curve if p.loss is not None]
    loss_range = (min(losses), max(losses)) if losses else None
    seconds_range = (0.0, max(p.seconds for p in curve))
    x = _scale(first, last, WIDTH, flip=False)
    loss_y = _scale(*(loss_range or (0.0, 1.0)), PANEL, flip=True)
    seconds_y = _scale(*seconds_range, PANEL, flip=True)
    series = []
    for (attempt, rolled_back), points in groupby(curve, key=lambda p: (p.attempt, p.rolled_back)):
        points = list(points)
        mid = [x((p.first_step + p.last_step) / 2) for p in points]
        with_loss = [(m, p.loss) for m, p in zip(mid, points, strict=True) if p.loss is not None]
        series.append(Series(attempt, rolled_back,
                             _points([m for m, _ in with_loss], [loss_y(v) for _, v in with_loss]) if with_loss else "",
                             _points(mid, [seconds_y(p.seconds) for p in points])))  # fmt: skip
    return StepChart(series, [Size(s["attempt"], s["nodes"], s["full_nodes"]) for s in sizes], (first, last),
                     loss_range, seconds_range)  # fmt: skip
