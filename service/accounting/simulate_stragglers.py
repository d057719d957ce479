"""Stragglers at fleet scale (`ett simulate --stragglers`): what slow nodes cost a synchronous job,
left alone (`report`) or replaced when that pays (`replace`), so the policy's threshold shows.

The model: slowdowns start on the job's nodes as a Poisson process (`rate_per_node_day` per
node); each has a factor f = 1 + (median - 1) x lognormal(sigma) and, left alone, lasts an
exponential time (mean `lasting_hours`). The job runs at its slowest node's pace: 1 / max f of
the slowdowns under way. A slowdown of at least `flag_factor` is flagged `detection_steps` steps
(at its slowed pace) after it starts (service/stragglers/scoring.py: three windows of five; a lag
under 15% of the step is never flagged). With `replace` the service then
compares, as it does, the slowdown's cost over the job's remaining time, (1 - 1/f) x remaining,
with a restart's, `restart_seconds` (detection of the stop, rescheduling, start-up and restore:
the fleet model's R + I + S), and restarts without the node when the slowdown costs more: the
job stands still for `restart_seconds` and that slowdown is gone. Nothing is lost beyond that:
the stop saves a checkpoint first.

Reported: the share of the wall time productive at full speed (the integral of the pace), the
slow time, the time restarting, the replacements. Deterministic for a seed.
"""

import heapq
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class StragglerModel:
    nodes: int = 2048
    days: float = 54.0
    step_seconds: float = 10.0
    rate_per_node_day: float = 0.005  # slowdowns starting per node per day: ~10 a day on 2,048 nodes
    slowdown_median: float = 1.3
    slowdown_sigma: float = 0.5
    lasting_hours: float = 12.0
    detection_steps: int = 15
    flag_factor: float = 1.15  # a slowdown under this is never flagged (STEP_SHARE in service/stragglers/scoring.py)
    restart_seconds: float = 540.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.slowdown_median <= 1 or min(self.days, self.step_seconds, self.lasting_hours) <= 0:
            raise ValueError("slowdown_median must be > 1 and days, step_seconds, lasting_hours > 0")


@dataclass(frozen=True)
class StragglerOutcome:
    policy: str
    full_speed_percent: float
    slow_seconds: float
    restart_seconds: float
    slowdowns: int
    replaced: int


def _slowdowns(m: StragglerModel) -> list[tuple[float, float, float]]:
    """(start, natural end, factor) of every slowdown over the job's wall time, in start order."""
    rng = random.Random(m.seed)
    end, rate = m.days * 86400, m.rate_per_node_day * m.nodes / 86400
    found, t = [], rng.expovariate(rate)
    while t < end:
        factor = 1 + (m.slowdown_median - 1) * math.exp(m.slowdown_sigma * rng.gauss(0, 1))
        found.append((t, t + rng.expovariate(1 / (m.lasting_hours * 3600)), factor))
        t += rng.expovariate(rate)
    return found


def simulate_stragglers(m: StragglerModel, policy: str) -> StragglerOutcome:
    """The job's wall time under the model, with `policy` report or replace."""
    end = m.days * 86400
    slowdowns = _slowdowns(m)
    changes: list[tuple[float, int, str, int]] = []  # (time, order, what, slowdown)
    for i, (start, stop, factor) in enumerate(slowdowns):
        heapq.heappush(changes, (start, 0, "start", i))
        heapq.heappush(changes, (min(stop, end), 1, "stop", i))
        if policy == "replace" and factor >= m.flag_factor:
            heapq.heappush(changes, (start + m.detection_steps * m.step_seconds * factor, 2, "flag", i))
    active: set[int] = set()
    t, productive, slow, restarting, replaced, down_until = 0.0, 0.0, 0.0, 0.0, 0, 0.0
    while changes and t < end:
        when, _, what, i = heapq.heappop(changes)
        when = min(when, end)
        running_from = max(t, down_until)
        if when > running_from:  # the stretch since the last change, at the slowest active pace
            pace = 1 / max((slowdowns[j][2] for j in active), default=1.0)
            productive += (when - running_from) * pace
            slow += (when - running_from) * (1 - pace)
        t = when
        if what == "start":
            active.add(i)
        elif what == "stop":
            active.discard(i)
        elif i in active and (1 - 1 / slowdowns[i][2]) * (end - t) > m.restart_seconds:
            active.discard(i)  # replaced: its node is left out of the next attempt
            replaced += 1
            stand_still = min(end, max(t, down_until) + m.restart_seconds) - max(t, down_until)
            restarting += stand_still
            down_until = max(t, down_until) + m.restart_seconds
    if t < end and end > max(t, down_until):
        pace = 1 / max((slowdowns[j][2] for j in active), default=1.0)
        productive += (end - max(t, down_until)) * pace
        slow += (end - max(t, down_until)) * (1 - pace)
    return StragglerOutcome(policy, 100 * productive / end, slow, restarting, len(slowdowns), replaced)


MEDIANS = (1.02, 1.05, 1.1, 1.3, 2.0)
LASTING_HOURS = (0.1, 1.0, 12.0)


def straggler_sweep(m: StragglerModel, medians: tuple[float, ...] = MEDIANS, lasting: tuple[float, ...] = LASTING_HOURS
                    ) -> list[tuple[float, float, StragglerOutcome, StragglerOutcome]]:
    """report against replace for slowdowns of each median factor and mean length (the same onsets).
    Short slowdowns are where replacing loses: the rule assumes a slowdown lasts to the job's end."""
    rows = []
    for hours in lasting:
        for median in medians:
            model = StragglerModel(**{**m.__dict__, "slowdown_median": median, "lasting_hours": hours})
            rows.append((median, hours, simulate_stragglers(model, "report"), simulate_stragglers(model, "replace")))
    return rows
