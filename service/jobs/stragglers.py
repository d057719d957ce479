"""Stragglers: the ranks whose peers wait for them (docs/reliability.md, "Stragglers").

Every WINDOW steps each rank reports its window's median work, the time before it reached the
step's synchronisation (ett/timing.py; the step's time where it marks none), and its second-
lowest. In a window every rank reported, a rank is slow when both its median and its second-
lowest work exceed its peers' by RELATIVE_LIMIT times *and* by STEP_SHARE of the step: a lag too
small to cost the job that share of its step is left alone, however large its ratio (on a shared
machine a 2 ms mark can read 6 ms), and so is a rank that was slow in a step or two of the five
(another process took its core for a moment). WINDOWS_IN_A_ROW
such windows flag it, naming its node; the individual score (its work over its own early in the
attempt) says whether the node became slow or always was.

With `stragglers = "replace"` the flag also weighs what the slowdown will cost over the job's
remaining steps against what a restart costs (the attempt's measured start-up; the stop saves a
final checkpoint, so no step is lost), and when the slowdown costs more, ends the attempt as a
failure of cause `straggler` (its ranks get SIGTERM: a save, then a clean exit) and the next
attempt starts without that node. A flag never drains the node: the step times are the job's own
words (its ranks write them, and a rank that sleeps is slow), so one job alone could flag a healthy
node again and again; the flags show in `ett nodes` for an admin to judge, and only node evidence
drains (service/agents/node_evidence.py).
"""

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from service.accounting.accounts import job_account
from service.jobs import notifications
from service.jobs.scheduler import fail_attempt
from service.models import STEP_TIMINGS, Attempt, AttemptNode, AttemptState, JobEvent, StragglerFlag

RELATIVE_LIMIT = 1.5
STEP_SHARE = 0.15
WINDOWS_IN_A_ROW = 3  # two flagged a healthy rank under CI's load once; three: by step S + 17 at the latest
LOOKBACK_STEPS = 60  # the windows read each pass: enough for WINDOWS_IN_A_ROW complete ones
EARLY_WINDOWS = 3  # a rank's own baseline: its median over the attempt's first complete windows but one
# A slowdown shorter than this is the machine's scheduling noise, not a straggler: a healthy rank of
# a job of 50 ms steps, starved of its core for 0.8 s on a shared 2-core machine, was flagged (CI,
# 2026-11-27). Steps of a real job last far longer: three windows of them pass this at once.
MIN_SLOW_SECONDS = 1.5


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Straggler:
    rank: int
    since_step: int
    flagged_step: int
    relative: float
    work_seconds: float
    peer_seconds: float
    step_seconds: float  # the window's median step time


def complete_windows(timings: Sequence[Timing], world: int) -> list[dict[int, Timing]]:
    """The windows every rank reported, oldest first."""
    windows: dict[int, dict[int, Timing]] = defaultdict(dict)
    for t in timings:
        windows[t.step][t.rank] = t
    return [windows[step] for step in sorted(windows) if len(windows[step]) == world]


def _slow_in(window: dict[int, Timing], rank: int) -> Straggler | None:
    mine = window[rank]
    step_seconds = statistics.median(t.duration for t in window.values())
    for value, peer_value in ((mine.value, statistics.median(t.value for r, t in window.items() if r != rank)),
                              (mine.steady, statistics.median(t.steady for r, t in window.items() if r != rank))):
        if value - peer_value < STEP_SHARE * step_seconds or value < RELATIVE_LIMIT * peer_value:
            return None
    peers = statistics.median(t.value for r, t in window.items() if r != rank)
    relative = mine.value / peers if peers > 0 else float("inf")
    return Straggler(rank, mine.step, mine.step, relative, mine.value, peers, step_seconds)


def find_stragglers(timings: Sequence[Timing], world: int) -> list[Straggler]:
    """The ranks slow in each of the newest WINDOWS_IN_A_ROW complete windows (and since when)."""
    windows = complete_windows(timings, world)
    if world < 2 or len(windows) < WINDOWS_IN_A_ROW:
        return []
    found = []
    for rank in range(world):
        run = []
        for window in reversed(windows):
            slow = _slow_in(window, rank)
            if slow is None:
                break
            run.append(slow)
        if len(run) >= WINDOWS_IN_A_ROW and _lasted(run) >= MIN_SLOW_SECONDS:
            newest, first = run[0], run[-1]
            found.append(Straggler(rank, first.since_step, newest.flagged_step, newest.relative, newest.work_seconds,
                                   newest.peer_seconds, newest.step_seconds))
    return found


def _lasted(run: list[Straggler]) -> float:
    """About how long a run of slow windows (newest first) lasted: its steps times their step time."""
    steps_per_window = (run[0].flagged_step - run[-1].since_step) / (len(run) - 1)
    return steps_per_window * sum(s.step_seconds for s in run)


def _timings(session: Session, attempt: Attempt, since_step: int | None = None, rank: int | None = None
             ) -> list[Timing]:
    query = select(JobEvent.source, JobEvent.step, JobEvent.data).where(
        JobEvent.job_id == attempt.job_id, JobEvent.attempt == attempt.number, STEP_TIMINGS)
    if since_step is not None:
        query = query.where(JobEvent.step > since_step)
    if rank is not None:
        query = query.where(JobEvent.source == f"rank:{rank}")
    found = []
    for source, step, data in session.execute(query.order_by(JobEvent.step)):
        try:
            work, low = (None if data.get(k) is None else float(data[k]) for k in ("work", "work_low"))
            found.append(Timing(int(source.removeprefix("rank:")), int(step), float(data["duration"]), work,
                                data.get("total_steps"), low))
        except (KeyError, TypeError, ValueError):
            continue  # not a window a rank of ours wrote: nothing to compare
    return found


def watch(session: Session, now: float) -> None:
    """One pass over the running attempts of more than one rank: new stragglers are recorded (and,
    by the job's policy, replaced)."""
    running = session.scalars(select(Attempt).where(Attempt.state == AttemptState.running)
                              .options(selectinload(Attempt.nodes).selectinload(AttemptNode.node))).all()
    for attempt in running:
        spec = attempt.job.spec
        world = spec.nodes * spec.procs_per_node
        if world < 2:
            continue
        newest = session.scalar(select(func.max(JobEvent.step)).where(
            JobEvent.job_id == attempt.job_id, JobEvent.attempt == attempt.number, STEP_TIMINGS))
        if newest is None:
            continue
        timings = _timings(session, attempt, since_step=newest - LOOKBACK_STEPS)
        flagged = set(session.scalars(select(StragglerFlag.rank).where(
            StragglerFlag.job_id == attempt.job_id, StragglerFlag.attempt == attempt.number)))
        for straggler in find_stragglers(timings, world):
            if straggler.rank not in flagged:
                _flag(session, attempt, straggler, timings, now)
                if attempt.state != AttemptState.running:
                    break  # replaced: its other ranks are no longer compared


def _flag(session: Session, attempt: Attempt, s: Straggler, timings: list[Timing], now: float) -> None:
    node = attempt.nodes[s.rank // attempt.job.spec.procs_per_node].node
    early = [t.value for t in _timings(session, attempt, rank=s.rank)[1 : 1 + EARLY_WINDOWS]]
    individual = s.work_seconds / statistics.median(early) if early and statistics.median(early) > 0 else None
    flag = StragglerFlag(job_id=attempt.job_id, attempt=attempt.number, rank=s.rank, node=node.name,
                         since_step=s.since_step, flagged_step=s.flagged_step, relative=round(s.relative, 3),
                         individual=None if individual is None else round(individual, 3),
                         work_seconds=s.work_seconds, peer_seconds=s.peer_seconds, action="reported",
                         flagged_at=datetime.fromtimestamp(now, UTC))
    session.add(flag)
    slow_cost, restart_cost = 0.0, float("inf")
    if attempt.job.spec.stragglers == "replace":
        slow_cost, restart_cost = replacement_costs(session, attempt, s, timings)
        flag.action = "replaced" if slow_cost > restart_cost else flag.action
    notifications.record(session, attempt.job, "straggler", f"straggler:{attempt.number}:{s.rank}", attempt.number,
                         {"rank": s.rank, "node": node.name, "relative": flag.relative, "since_step": s.since_step,
                          "flagged_step": s.flagged_step, "action": flag.action}, now)  # fmt: skip
    if flag.action == "replaced":
        detail = (f"rank {s.rank} on {node.name} straggled: {s.relative:.1f}x its peers' work since step "
                  f"{s.since_step}; the slowdown would cost {slow_cost:.1f} s, a restart {restart_cost:.1f} s")
        fail_attempt(session, attempt, "straggler", detail, now, node=node)


def replacement_costs(session: Session, attempt: Attempt, s: Straggler, timings: list[Timing]) -> tuple[float, float]:
    """(what the slowdown costs over the remaining steps, what a restart costs), in seconds. The
    remaining steps are the job's total as its ranks report it (the trainer, the Hugging Face
    Trainer, `run.total_steps`), else as many again as it has made."""
    total = max((t.total_steps for t in timings if t.total_steps), default=None)
    remaining = max(0, total - s.flagged_step) if total else s.flagged_step
    slow_cost = (s.work_seconds - s.peer_seconds) * remaining
    summary = job_account(session, attempt.job_id).attempts.get(attempt.number)
    if summary is None or summary.start is None or summary.first_step_start is None:
        return slow_cost, float("inf")  # nothing measured yet: no restart
    startup = max(0.0, summary.first_step_start - summary.start)
    # A script that checkpoints through ETT saves as it stops; any other loses its attempt's steps.
    checkpoints = summary.committed > 0 or summary.blocking_count > 0
    lost = 0.0 if checkpoints else (s.flagged_step - (summary.restored_step or 0)) * s.step_seconds
    return slow_cost, startup + lost
