"""Slow time (docs/ett.md, "Slow time"): an attempt's step times, kept in buckets 2% wide with
each bucket's count and summed seconds, a bounded and order-independent summary (JSON: bucket ->
[steps, seconds]) from which its ideal step time and the time its kept steps took above it follow.
"""

import math
from collections.abc import Iterable

BUCKET_RATIO = 1.02
IDEAL_PERCENTILE = 0.10  # the ideal step: the 10th percentile of the attempt's steps
IDEAL_MIN_STEPS = 10  # fewer steps tell no ideal: no slow time


def add_steps(buckets: dict[str, list[float]], durations: Iterable[float]) -> None:
    for duration in durations:
        bucket = buckets.setdefault(str(math.floor(math.log(max(duration, 1e-6)) / math.log(BUCKET_RATIO))), [0, 0.0])
        bucket[0] += 1
        bucket[1] += duration


def ideal_step(buckets: dict[str, list[float]], steps: int) -> float | None:
    """The mean step of the bucket at IDEAL_PERCENTILE of the steps (None: fewer than IDEAL_MIN_STEPS).
    A low percentile, not the median: a job slow half its time would call that slowness ideal."""
    if steps < IDEAL_MIN_STEPS:
        return None
    seen, wanted = 0.0, IDEAL_PERCENTILE * steps
    for _, (count, seconds) in sorted(buckets.items(), key=lambda kv: int(kv[0])):
        seen += count
        if seen >= wanted:
            return seconds / count
    return None


def slow_seconds(buckets: dict[str, list[float]], steps: int, wasted_steps: int, wasted_seconds: float) -> float:
    """The kept steps' time above the ideal step, each step's excess summed. Rolled-back steps are
    wasted, not slow: their excess is taken off (each counted at least the ideal)."""
    ideal = ideal_step(buckets, steps)
    if ideal is None:
        return 0.0
    excess = sum(max(0.0, seconds - count * ideal) for count, seconds in buckets.values())
    return max(0.0, excess - max(0.0, wasted_seconds - wasted_steps * ideal))
