"""Event ingestion: the one code path behind the agents' batch endpoint, the admin replay endpoint
and the service's own events.

A batch is stored whole or not at all, in one transaction whatever the number of its jobs: the
jobs' accounting rows are locked in one query (SELECT ... FOR UPDATE on PostgreSQL, in job order;
SQLite has one writer at a time). On PostgreSQL the events go into `events` by one COPY in a
savepoint; when one of them is stored already (a repeat), and on SQLite, they are staged in a
temporary table (COPY, or executemany: no per-row work in Python beyond building a tuple) and
moved into `events` by one INSERT ... SELECT ... ON CONFLICT DO NOTHING on (job, attempt, source,
seq) that returns the keys it stored. A repeat with the same content is ignored and one with
other content rejects the batch; only the new events are folded into their job's `JobAccount`
(service/accounting/engine.py), rank 0's steps one attempt at a time, and their checkpoint events into
the job's checkpoint records. A job's new events past its bound are left out and answered `refused`
(service/ingest/bound.py). The job's secrets (the values of its `env`) are blanked in every string of
a rank's event's `data` before it is stored, as on the node (ett/protocol/redaction.py): a job may
write any field, and an agent that restarted no longer knows them.
"""

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sqlalchemy import JSON, Row, bindparam, func, insert, select, tuple_, type_coerce, update
from sqlalchemy.orm import Session

from ett.protocol.event_fields import EVENT_FIELDS
from ett.protocol.redaction import Secrets
from service.accounting.engine import CheckpointRecord, Event, JobAccount
from service.accounting.fold import fold, is_checkpoint
from service.accounting.step_times import step_saving
from service.ingest.bound import take_past_bound
from service.ingest.rows import (
    EventRow,
    Pending,
    chunks,
    dialect_insert,
    encode_data,
    store_new,
    stored_events,
)
from service.models import JOB_WORLD_SIZE, RANK0_STEPS, Checkpoint, Job, JobAccountRow, JobEvent
from service.schemas.events import EventIn
from service.settings import Settings


# Each kind's fields an event must have (a step's duration): a declared number that is a secret is
# dropped (ett/protocol/redaction.py), and an event without one of these is refused.
REQUIRED_FIELDS: dict[str, frozenset[str]] = {kind: fields.__required_keys__ for kind, fields in EVENT_FIELDS.items()}


class EventRejected(Exception):
    """One event makes the whole batch unacceptable; `field` is its path in the request."""

    def __init__(self, index: int, field: str, msg: str) -> None:
        super().__init__(msg)
        self.field, self.msg = f"events.{index}.{field}", msg


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int
    stored: frozenset[int]  # the indexes in the batch of the events stored by it
    refused: frozenset[int] = frozenset()  # ... of those past their job's bound, not stored (the rest: repeats)
    over_bound: frozenset[str] = frozenset()  # the jobs they belong to, to be stopped (service/jobs/event_limit.py)


class _SqlSteps:
    """The engine's StepLookup over the events table (the partial index ix_events_rank0_steps)."""

    def __init__(self, session: Session, job_id: str) -> None:
        self.session, self.job_id = session, job_id

    def steps_above(self, attempt: int, step: int) -> tuple[int, float]:
        count, seconds = self.session.execute(
            select(func.count(), func.coalesce(func.sum(JobEvent.duration), 0.0)).where(
                JobEvent.job_id == self.job_id, JobEvent.attempt == attempt, JobEvent.step > step, RANK0_STEPS,
            )  # fmt: skip
        ).one()
        return int(count), float(seconds)


def ingest(
    session: Session,
    batch: Sequence[tuple[str, EventIn]],
    *,
    clock_offsets: Sequence[float] | None = None,
    settings: Settings | None = None,
    copy_in_savepoint: bool = True,
) -> IngestResult:
    """Stores and accounts a batch of (job id, event); raises EventRejected, leaving the caller
    to roll back. `clock_offsets`: each event's node's clock offset (None: all 0). `settings`
    brings the limits on data size, future times and events per job (None: the service's own
    events, trusted).
    `copy_in_savepoint`: False for a caller that ingests event by event in one transaction (the
    savepoint is a subtransaction, and past 64 in one transaction PostgreSQL slows every other
    session's snapshots). The caller commits."""
    now = time.time()
    max_bytes = settings.max_event_data_bytes if settings is not None else math.inf
    ahead = settings.max_event_future_seconds if settings is not None else math.inf
    by_job: dict[str, dict[tuple[int, str, int], Pending]] = defaultdict(dict)  # first of each key, per job
    worlds, secrets = _jobs(session, {job_id for job_id, _ in batch}, untrusted=settings is not None)
    for i, (job_id, e) in enumerate(batch):
        clock_offset = clock_offsets[i] if clock_offsets is not None else 0.0
        latest_ts = now + ahead - clock_offset
        if job_id in secrets and e.source.startswith("rank:"):
            secrets[job_id].blank_data(e.kind, e.data)
            if missing := sorted(REQUIRED_FIELDS.get(e.kind, frozenset()) - e.data.keys()):  # a secret, dropped
                raise EventRejected(i, f"data.{missing[0]}", "a secret of the job's env: dropped, its event with it")
        data, encoded = encode_data(e.data)
        if len(encoded) > max_bytes:
            raise EventRejected(i, "data", f"data is over the limit of {max_bytes} bytes")
        if e.ts > latest_ts:
            msg = f"ts is {e.ts + clock_offset - now:.0f} s ahead of the service's clock (after skew correction)"
            raise EventRejected(i, "ts", msg)
        duration = float(data["duration"]) if e.kind == "step" else None
        ts = e.ts + clock_offset
        row = EventRow(job_id, e.attempt, e.source, e.seq, e.kind, ts, clock_offset, e.step, duration, encoded.decode())
        pending = Pending(row, data, i)
        earlier = by_job[job_id].setdefault(pending.key, pending)
        if earlier is not pending:
            if _content(earlier.row, earlier.data) != _content(row, data):
                raise EventRejected(i, "seq", _conflict_message(row, "sent"))
    _check_jobs_exist(worlds, by_job)
    accounts = _lock_accounts(session, sorted(by_job))
    past = {} if settings is None else take_past_bound(
        session, by_job, {job_id: row.events for job_id, row in accounts.items()}, worlds, settings)
    stored = store_new(session, [p.row for events in by_job.values() for p in events.values()], copy_in_savepoint)
    fresh: dict[str, list[Pending]] = {}
    for job_id, events in by_job.items():
        fresh[job_id] = [p for p in events.values() if (job_id, *p.key) in stored]
        if len(fresh[job_id]) < len(events):  # the others were stored before: each must be a true repeat
            _check_repeats(session, job_id, [p for p in events.values() if (job_id, *p.key) not in stored])
    records = _Records(session, [p for events in fresh.values() for p in events])
    updates = [_account(session, account_row, fresh[job_id], records) for job_id, account_row in accounts.items()]
    if updates:
        session.execute(update(JobAccountRow), updates)  # by primary key, one executemany
    records.write(session)
    new = frozenset(p.index for events in fresh.values() for p in events)
    refused = frozenset(i for i, (job_id, e) in enumerate(batch)
                        if (e.attempt, e.source, e.seq) in past.get(job_id, ())) if past else frozenset()  # fmt: skip
    return IngestResult(len(new), len(batch) - len(new) - len(refused), new, refused, frozenset(past))


def _content(row: EventRow | JobEvent, data: dict[str, Any]) -> tuple:
    # The emitter's own time: a repeat sent after the node's offset changed is still a repeat.
    return (row.kind, round(row.ts - row.clock_offset_seconds, 6), row.step, data)


def _conflict_message(row: EventRow, where: str) -> str:
    return f"seq {row.seq} of {row.source} in attempt {row.attempt} was already {where} with other content"


def _jobs(session: Session, job_ids: set[str], untrusted: bool) -> tuple[dict[str, int], dict[str, Secrets]]:
    """Each job's number of ranks, and (`untrusted`: an agent's batch) its secrets where it has any, by id."""
    # FOR KEY SHARE (PostgreSQL): the job before its accounting row, in the order the scheduler
    # takes them (it locks jobs, then emits events), so the two never wait on each other in a circle.
    columns = (Job.id, JOB_WORLD_SIZE, *([type_coerce(Job.spec["env"], JSON)] if untrusted else []))
    query = (
        select(*columns).where(Job.id.in_(list(job_ids))).order_by(Job.id)
        .with_for_update(read=True, key_share=True)
    )  # fmt: skip
    worlds, secrets = {}, {}
    for row in session.execute(query):
        worlds[row[0]] = row[1]
        if untrusted and row[2] and (compiled := _secrets(tuple(sorted(set(row[2].values()))))):
            secrets[row[0]] = compiled
    return worlds, secrets


@lru_cache(maxsize=64)
def _secrets(values: tuple[str, ...]) -> Secrets:
    """A job's secrets, compiled once for all its batches (a job's env may hold 256 values of 4 Ki characters)."""
    return Secrets(values)


def _check_jobs_exist(worlds: dict[str, int], by_job: dict[str, dict[Any, Pending]]) -> None:
    """EventRejected naming the first event of a job that does not exist."""
    for job_id, events in by_job.items():
        if job_id not in worlds:
            raise EventRejected(min(p.index for p in events.values()), "job_id", f"no job {job_id}")


def _lock_accounts(session: Session, job_ids: list[str]) -> dict[str, Row]:
    """The jobs' accounting rows (job_id, account, events), locked in job order (one order for
    every process: no deadlock between jobs); created if missing first, which on SQLite takes the
    database's write lock at once. Plain rows: a burst's hundreds of jobs as ORM objects (loaded,
    tracked, flushed) cost more than their accounting."""
    rows = [{"job_id": job_id, "account": {}, "failures": 0, "events": 0} for job_id in job_ids]
    # One statement run for each row (executemany): compiled once, where a multi-row VALUES of
    # a new length each time was compiled anew for every batch.
    session.execute(dialect_insert(session)(JobAccountRow.__table__).on_conflict_do_nothing(), rows)
    return {row.job_id: row for row in session.execute(_LOCK_ACCOUNTS, {"jobs": job_ids})}


def _account(session: Session, account_row: Row, new: list[Pending], records: "_Records") -> dict[str, Any]:
    """Folds a job's new events into its accounting row, returned as the row's new values, and
    their checkpoint events into `records`."""
    account = JobAccount.from_dict(account_row.account)
    fold(account, new, duration=_step_duration, event=_event, record=lambda p: records.get(p.job_id, p.attempt, p.step),
         saving=lambda p: step_saving(p.data))
    account.settle(_SqlSteps(session, account_row.job_id))
    starts = [a.start for a in account.attempts.values() if a.start is not None]
    return {
        "job_id": account_row.job_id,
        "account": account.to_dict(),
        "window_start": min(starts) if starts else None,
        "finished_at": account.finished_at,
        "last_event_at": account.last_event_at,
        "failures": sum(a.failed_at is not None for a in account.attempts.values()),
        "events": account_row.events + len(new),
    }


def _check_repeats(session: Session, job_id: str, repeats: list[Pending]) -> None:
    """Each repeat must have the stored event's content."""
    existing = stored_events(session, job_id, [p.key for p in repeats])
    for p in repeats:
        stored = existing[p.key]
        if _content(stored, stored.data) != _content(p.row, p.data):
            raise EventRejected(p.index, "seq", _conflict_message(p.row, "stored"))


class _Records:
    """The checkpoint records a batch's checkpoint events update, by (job, attempt, step): read
    for all jobs of the batch in one query, written back in one statement for the new ones and
    one for the changed ones."""

    def __init__(self, session: Session, events: list[Pending]) -> None:
        keys = list({(p.row.job_id, p.row.attempt, p.row.step) for p in events if is_checkpoint(p.row)})
        self.found: dict[tuple[str, int, int], tuple[int, CheckpointRecord]] = {}  # with the row's id
        self.made: dict[tuple[str, int, int], CheckpointRecord] = {}
        self.changed: set[tuple[str, int, int]] = set()
        for chunk in chunks(keys):
            found = tuple_(Checkpoint.job_id, Checkpoint.attempt, Checkpoint.step).in_(chunk)
            for row in session.execute(select(Checkpoint.id, Checkpoint.job_id, *_RECORD_COLUMNS).where(found)):
                record = CheckpointRecord(*row[2:])
                self.found[(row.job_id, record.attempt, record.step)] = (row.id, record)

    def get(self, job_id: str, attempt: int, step: int) -> CheckpointRecord:
        """The record, made if new; marked to be written back."""
        key = (job_id, attempt, step)
        if key in self.found:
            self.changed.add(key)
            return self.found[key][1]
        if key not in self.made:
            self.made[key] = CheckpointRecord(attempt, step)
        return self.made[key]

    def write(self, session: Session) -> None:
        def values(job_id: str, record: CheckpointRecord) -> dict[str, Any]:
            return {"job_id": job_id, **{f: getattr(record, f) for f in CheckpointRecord.__slots__}}

        if self.made:
            session.execute(insert(Checkpoint), [values(key[0], r) for key, r in self.made.items()])
        if self.changed:
            updates = [{"id": self.found[key][0], **values(key[0], self.found[key][1])} for key in self.changed]
            session.execute(update(Checkpoint), updates)


# Statements built once (built per batch, each left cyclic garbage for the collector).
_LOCK_ACCOUNTS = (
    select(JobAccountRow.job_id, JobAccountRow.account, JobAccountRow.events)
    .where(JobAccountRow.job_id.in_(bindparam("jobs", expanding=True))).order_by(JobAccountRow.job_id)
    .with_for_update()
)  # fmt: skip
_RECORD_COLUMNS = [getattr(Checkpoint, f) for f in CheckpointRecord.__slots__]  # attempt, step, started_at, ...


def _step_duration(p: Pending) -> float:
    return p.row.duration


def _event(p: Pending) -> Event:
    r = p.row
    return Event(r.kind, r.ts, r.attempt, r.source, r.seq, r.step, p.data)


def ingest_trusted(session: Session, job_id: str, events: Sequence[dict[str, Any]]) -> IngestResult:
    """The service's own events (service/jobs/service_events.py), inside the caller's transaction."""
    return ingest(session, [(job_id, EventIn.model_validate(e)) for e in events], copy_in_savepoint=False)
