"""The straggler watch: each pass of the service's clock reads the step timings that arrived since
the last and scores them (service/stragglers/scoring.py); a new straggler is recorded, and its
job's policy applied (service/stragglers/policy.py), in a transaction of its own.

It runs beside the scheduler's tick, never inside its transaction: reading and scoring a big
job's windows holds no lock, and only a straggler, a rare thing, writes. Each attempt's score
lives in this process; one started afresh (a service start) reads back LOOKBACK_STEPS steps.
Several service processes each score alike, and the first to flag a rank wins (the attempt's
row is locked, then the flag looked for).
"""

import statistics
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta

import orjson
from sqlalchemy import Row, Select, String, func, select, tuple_, type_coerce
from sqlalchemy.orm import Session

from service.jobs import notifications
from service.jobs.scheduler import fail_attempt
from service.models import STEP_TIMINGS, Attempt, AttemptState, Job, JobEvent, StragglerFlag
from service.settings import Settings
from service.stragglers.policy import decide
from service.stragglers.scoring import LOOKBACK_STEPS, AttemptScore, Straggler, Timing

EARLY_WINDOWS = 3  # a rank's own baseline: its median over the attempt's first complete windows but one


# A pass reads for this long at most, in chunks of READ_ROWS: a window of a big job arrives over a
# few passes, each within the 50 ms a pass may take (bench/straggler_scoring.py); a small job's in one.
PASS_SECONDS = 0.025
READ_ROWS = 512


class Watch:
    """The running attempts' scores, kept from pass to pass."""

    def __init__(self, pass_seconds: float = PASS_SECONDS) -> None:
        self.pass_seconds = pass_seconds
        self.scores: dict[int, AttemptScore] = {}  # by attempt id, the one read least lately first
        self.keys: dict[int, tuple[str, int]] = {}  # each attempt's job and number
        self.cursors: dict[int, tuple[int, int]] = {}  # the (step, event id) each attempt's windows were read to

    def run(self, sessions: Callable[[], Session], settings: Settings, now: float) -> list[Straggler]:
        """One pass: scores what arrived, then records each new straggler in a transaction of its own."""
        with sessions() as session:
            found = self.score(session)
        for attempt_id, straggler in found:
            with sessions() as session:
                record(session, attempt_id, straggler, settings, now)
                session.commit()
        return [s for _, s in found]

    def score(self, session: Session) -> list[tuple[int, Straggler]]:
        """Reads and scores the running attempts' new windows (a read, no lock): their new stragglers."""
        deadline = time.perf_counter() + self.pass_seconds
        running = set(session.scalars(select(Attempt.id).where(Attempt.state == AttemptState.running)))
        for gone in [a for a in self.scores if a not in running]:
            del self.scores[gone], self.keys[gone], self.cursors[gone]
        fresh = [a for a in running if a not in self.scores]
        if fresh:  # the job's spec is read once an attempt
            query = select(Attempt.id, Attempt.job_id, Attempt.number, Job.spec).join(Job)
            for attempt_id, job_id, number, spec in session.execute(query.where(Attempt.id.in_(fresh))):
                self.scores[attempt_id] = AttemptScore(spec.nodes * spec.procs_per_node)
                self.keys[attempt_id] = (job_id, number)
                newest = session.scalar(select(func.max(JobEvent.step)).where(
                    JobEvent.job_id == job_id, JobEvent.attempt == number, STEP_TIMINGS))
                self.cursors[attempt_id] = (-1, 0) if newest is None else (newest - LOOKBACK_STEPS, 2**62)
        found = []
        for attempt_id in list(self.scores):
            score, (job_id, number) = self.scores[attempt_id], self.keys[attempt_id]
            if score.world < 2:
                continue
            def reread(step: int, job_id: str = job_id, number: int = number) -> list[Timing]:
                return timings_of(session.connection().execute(window(job_id, number, step)))

            while True:
                rows = session.connection().execute(new_rows(job_id, number, self.cursors[attempt_id])).all()
                if rows:
                    self.cursors[attempt_id] = (rows[-1].step, rows[-1].id)
                found += [(attempt_id, s) for s in score.add(timings_of(rows), reread)]
                if len(rows) < READ_ROWS or time.perf_counter() > deadline:
                    break
            self.scores[attempt_id] = self.scores.pop(attempt_id)  # read last: the next pass reads the others first
            if time.perf_counter() > deadline:
                break  # the rest next pass
        return found


def _timings_query(job_id: str, attempt: int) -> Select:
    # The data as stored: decoded here, without the JSON type's layers (a third of a big window's read).
    return select(JobEvent.id, JobEvent.source, JobEvent.step, type_coerce(JobEvent.data, String).label("data")).where(
        JobEvent.job_id == job_id, JobEvent.attempt == attempt, STEP_TIMINGS)


def new_rows(job_id: str, attempt: int, after: tuple[int, int]) -> Select:
    """The attempt's next READ_ROWS windows after `after` (step, event id), in that order."""
    return (_timings_query(job_id, attempt).where(tuple_(JobEvent.step, JobEvent.id) > tuple_(*after))
            .order_by(JobEvent.step, JobEvent.id).limit(READ_ROWS))  # fmt: skip


def window(job_id: str, attempt: int, step: int) -> Select:
    return _timings_query(job_id, attempt).where(JobEvent.step == step)


def timings_of(rows: Iterable[Row]) -> list[Timing]:
    found = []
    for row in rows:
        try:
            data = orjson.loads(row.data) if isinstance(row.data, str | bytes) else row.data  # psycopg decodes json
            work, low = (None if data.get(k) is None else float(data[k]) for k in ("work", "work_low"))
            found.append(Timing(int(row.source.removeprefix("rank:")), int(row.step), float(data["duration"]), work,
                                data.get("total_steps"), low))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # not a window a rank of ours wrote: nothing to compare
    return found


def read_timings(session: Session, job_id: str, attempt: int, after_step: int, rank: int | None = None,
                 limit: int | None = None) -> list[Timing]:
    """The attempt's windows after `after_step` (of one rank, `limit` of them), oldest first."""
    query = _timings_query(job_id, attempt).where(JobEvent.step > after_step)
    if rank is not None:
        query = query.where(JobEvent.source == f"rank:{rank}")
    return timings_of(session.connection().execute(query.order_by(JobEvent.step).limit(limit)))


def record(session: Session, attempt_id: int, s: Straggler, settings: Settings, now: float) -> None:
    """Records a new straggler of the attempt, if it still runs and the rank is not flagged yet,
    with what the job's policy does about it (docs/reliability.md, "Stragglers")."""
    attempt = session.scalar(select(Attempt).where(Attempt.id == attempt_id).with_for_update())
    if attempt is None or attempt.state != AttemptState.running or session.scalar(select(StragglerFlag.id).where(
            StragglerFlag.job_id == attempt.job_id, StragglerFlag.attempt == attempt.number,
            StragglerFlag.rank == s.rank)) is not None:  # fmt: skip
        return
    node = attempt.nodes[s.rank // attempt.job.spec.procs_per_node].node
    early = [t.value for t in read_timings(session, attempt.job_id, attempt.number, -1, s.rank,
                                           1 + EARLY_WINDOWS)[1:]]  # fmt: skip
    individual = s.work_seconds / statistics.median(early) if early and statistics.median(early) > 0 else None
    fresh = datetime.fromtimestamp(now, UTC) - timedelta(seconds=settings.heartbeat_timeout_seconds)
    decision = decide(session, attempt, s, node, fresh)
    session.add(StragglerFlag(
        job_id=attempt.job_id, attempt=attempt.number, rank=s.rank, node=node.name, since_step=s.since_step,
        flagged_step=s.flagged_step, relative=round(s.relative, 3),
        individual=None if individual is None else round(individual, 3), work_seconds=s.work_seconds,
        peer_seconds=s.peer_seconds, action=decision.action, reason=decision.reason,
        follows_rank=decision.follows_rank, flagged_at=datetime.fromtimestamp(now, UTC)))  # fmt: skip
    notifications.record(session, attempt.job, "straggler", f"straggler:{attempt.number}:{s.rank}", attempt.number,
                         {"rank": s.rank, "node": node.name, "relative": round(s.relative, 3),
                          "since_step": s.since_step, "flagged_step": s.flagged_step, "action": decision.action,
                          "reason": decision.reason}, now)  # fmt: skip
    said = f"rank {s.rank} on {node.name} straggles: {s.relative:.1f}x its peers' work since step {s.since_step}"
    if decision.action == "kept":  # the job goes on where it runs, and says why (`ett jobs`, the job's API)
        attempt.job.reason = f"{said}; kept where it runs: {decision.reason}"[:512]
    elif decision.action == "replaced":
        detail = (f"{said}; the slowdown would cost {decision.slow_cost:.1f} s, a restart "
                  f"{decision.restart_cost:.1f} s")
        fail_attempt(session, attempt, "straggler", detail, now, node=node)
