"""The straggler watch: each pass of the service's clock reads the step timings that arrived since
the last and scores them (service/stragglers/scoring.py); a new straggler is recorded, and its
job's policy applied (service/stragglers/policy.py), in a transaction of its own.

It runs beside the scheduler's tick, never inside its transaction: reading and scoring a big
job's windows holds no lock, and only a straggler, a rare thing, writes. Each attempt's score
lives in this process; one started afresh (a service start) reads back LOOKBACK_STEPS steps.
Several service processes each score alike, and the first to flag a rank wins (the attempt's
row is locked, then the flag looked for). A flag whose write failed (a database error, a lost
connection) is written on a later pass: kept until it lands, never twice (the flag is looked for
first). Each pass also ends the holds of spares no replacement will take (service/stragglers/spares.py).
"""

import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import orjson
from sqlalchemy import Row, Select, String, bindparam, func, select, tuple_, type_coerce
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from service.webhooks import notifications
from service.jobs.scheduler import fail_attempt
from service.models import STEP_TIMINGS, Attempt, AttemptNode, AttemptState, Job, JobEvent, Node, StragglerFlag
from service.settings import Settings
from service.stragglers.policy import decide
from service.stragglers.scoring import EARLY_WINDOWS, LOOKBACK_STEPS, AttemptScore, Straggler, Timing
from service.stragglers.spares import hand_back, reserve_spare

log = logging.getLogger("ett.service")


# A pass reads for this long at most, in chunks of READ_ROWS: a window of a big job arrives over a
# few passes, each within the 50 ms a pass may take (bench/straggler_scoring.py); a small job's in one.
# A pass's work is bounded by what it reads: each row is put in its window's columns as it comes, and
# the pass that completes a window scores it in numpy (service/stragglers/scoring.py).
PASS_SECONDS = 0.025
READ_ROWS = 256


class Watch:
    """The running attempts' scores, kept from pass to pass."""

    def __init__(self, pass_seconds: float = PASS_SECONDS) -> None:
        self.pass_seconds = pass_seconds
        self.scores: dict[int, AttemptScore] = {}  # by attempt id, the one read least lately first
        self.keys: dict[int, tuple[str, int]] = {}  # each attempt's job and number
        self.cursors: dict[int, tuple[int, int]] = {}  # the (step, event id) each attempt's windows were read to
        # Stragglers found and not yet recorded, by (attempt id, rank): found once (a rank's run of
        # slow windows is told once), so a write that failed is tried again from here, each pass.
        self.unrecorded: dict[tuple[int, int], Straggler] = {}

    def run(self, sessions: Callable[[], Session], settings: Settings, now: float) -> list[Straggler]:
        """One pass: records the stragglers the last pass found (or failed to record), each in a
        transaction of its own, then scores what arrived, for what is left of PASS_SECONDS, and
        ends the holds of spares that no restart will end (service/stragglers/spares.py). A flag is
        written a pass after it is found (one tick): the pass that finds it has spent its time
        reading; a pass that recorded past PASS_SECONDS leaves its reading to the next. The
        stragglers found now."""
        deadline = time.perf_counter() + self.pass_seconds
        if self.record_found(sessions, settings, now) and time.perf_counter() > deadline:
            return []
        with sessions() as session:
            found = self.score(session, deadline)
            if hand_back(session, now):
                session.commit()
        return found

    def record_found(self, sessions: Callable[[], Session], settings: Settings, now: float) -> bool:
        """Records the stragglers found and not yet recorded; whether there were any."""
        tried = bool(self.unrecorded)
        for (attempt_id, rank), straggler in list(self.unrecorded.items()):
            try:
                with sessions() as session:
                    record(session, attempt_id, straggler, settings, now)
                    session.commit()
            except DBAPIError:  # the flag and what its policy does stay undone together: next pass
                log.warning("straggler rank %d of attempt %d not recorded; tried again next pass", rank, attempt_id,
                            exc_info=True)
                continue
            del self.unrecorded[(attempt_id, rank)]
        return tried

    def score(self, session: Session, deadline: float) -> list[Straggler]:
        """Reads and scores the running attempts' new windows until `deadline` (a read, no lock): their
        new stragglers, kept in `unrecorded` as each is found (a read that fails later loses none)."""
        running = set(session.scalars(select(Attempt.id).where(Attempt.state == AttemptState.running)))
        for gone in [a for a in self.scores if a not in running]:
            del self.scores[gone], self.keys[gone], self.cursors[gone]
        for key in [k for k in self.unrecorded if k[0] not in running]:
            del self.unrecorded[key]  # its attempt ended: a flag would be refused (record)
        fresh = [a for a in running if a not in self.scores]
        if fresh:  # the job's spec is read once an attempt
            # Its own nodes, not the job's: an elastic job's smaller attempt has fewer ranks (service/jobs/elastic.py).
            nodes = select(func.count()).where(AttemptNode.attempt_id == Attempt.id).scalar_subquery()
            query = select(Attempt.id, Attempt.job_id, Attempt.number, Job.spec, nodes).join(Job)
            for attempt_id, job_id, number, spec, count in session.execute(query.where(Attempt.id.in_(fresh))):
                self.keys[attempt_id] = (job_id, number)
                newest = session.scalar(select(func.max(JobEvent.step)).where(
                    JobEvent.job_id == job_id, JobEvent.attempt == number, STEP_TIMINGS))
                self.cursors[attempt_id] = (-1, 0) if newest is None else (newest - LOOKBACK_STEPS, 2**62)
                from_start = newest is None or newest < LOOKBACK_STEPS  # it reads the attempt's first windows
                self.scores[attempt_id] = AttemptScore(count * spec.procs_per_node, from_start)
        found, chunk = [], 0.0  # chunk: the last chunk's seconds, so that the next one is read only if it fits
        for attempt_id in list(self.scores):
            score, (job_id, number) = self.scores[attempt_id], self.keys[attempt_id]
            if score.world < 2:
                continue
            key = {"job_id": job_id, "attempt": number}

            def reread(step: int, ranks: list[int], key: dict = key) -> list[Timing]:
                sources = [f"rank:{rank}" for rank in ranks]
                return timings_of(session.connection().execute(_MISSING, key | {"step": step, "sources": sources}))

            while True:
                began = time.perf_counter()
                after_step, after_id = self.cursors[attempt_id]
                rows = session.connection().execute(_NEW_ROWS, key | {"after_step": after_step, "after_id": after_id}
                                                    ).all()  # fmt: skip
                if rows:
                    self.cursors[attempt_id] = (rows[-1].step, rows[-1].id)
                for straggler in score.add(timings_of(rows), reread):
                    self.unrecorded[(attempt_id, straggler.rank)] = straggler
                    found.append(straggler)
                chunk = time.perf_counter() - began
                if len(rows) < READ_ROWS or time.perf_counter() + chunk > deadline:
                    break
            self.scores[attempt_id] = self.scores.pop(attempt_id)  # read last: the next pass reads the others first
            if time.perf_counter() + chunk > deadline:
                break  # the rest next pass
        return found


# The data as stored: decoded here, without the JSON type's layers (a third of a big window's read).
_TIMINGS = select(JobEvent.id, JobEvent.source, JobEvent.step, type_coerce(JobEvent.data, String).label("data")
                  ).where(STEP_TIMINGS)  # fmt: skip
_OF_ATTEMPT = (JobEvent.job_id == bindparam("job_id"), JobEvent.attempt == bindparam("attempt"))
# A pass's statements, built once (building them cost about as much as a small read): an attempt's next
# READ_ROWS windows after (step, event id), in that order; and a window's rows of some ranks.
_NEW_ROWS = (_TIMINGS.where(*_OF_ATTEMPT, tuple_(JobEvent.step, JobEvent.id) > tuple_(bindparam("after_step"),
                                                                                      bindparam("after_id")))
             .order_by(JobEvent.step, JobEvent.id).limit(READ_ROWS))  # fmt: skip
_MISSING = _TIMINGS.where(*_OF_ATTEMPT, JobEvent.step == bindparam("step"),
                          JobEvent.source.in_(bindparam("sources", expanding=True)))


def _timings_query(job_id: str, attempt: int) -> Select:
    return _TIMINGS.where(JobEvent.job_id == job_id, JobEvent.attempt == attempt)


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
    node = session.scalar(select(Node).join(AttemptNode).where(  # its share alone, not the attempt's thousands
        AttemptNode.attempt_id == attempt.id, AttemptNode.node_rank == s.rank // attempt.job.spec.procs_per_node))
    early = s.baseline_seconds
    if early is None:  # its score began mid-attempt (a service start): the rank's first windows read back
        values = [t.value for t in read_timings(session, attempt.job_id, attempt.number, -1, s.rank,
                                                1 + EARLY_WINDOWS)[1:]]  # fmt: skip
        early = statistics.median(values) if values else None
    individual = s.work_seconds / early if early and early > 0 else None
    fresh = datetime.fromtimestamp(now, UTC) - timedelta(seconds=settings.heartbeat_timeout_seconds)
    decision = decide(session, attempt, s, node, fresh)
    if decision.spare and not reserve_spare(session, attempt, fresh):  # taken since it was counted: no stop for nothing
        decision = replace(decision, action="kept", reason="no spare node was free", spare=False)
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
