"""Event ingestion: the one code path behind the agents' batch endpoint, the admin replay endpoint
and the service's own events.

A batch is stored whole or not at all. Per job, in one transaction: the job's accounting row is
locked (SELECT ... FOR UPDATE on PostgreSQL; SQLite has one writer at a time), the events go in
with one bulk INSERT ... ON CONFLICT DO NOTHING on (job, attempt, source, seq), a repeat with the
same content is ignored and one with other content rejects the batch, and only the new events are
folded into the job's `JobAccount` (service/ett/engine.py) and its checkpoint records.
"""

import json
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.ett.engine import CHECKPOINT_KINDS, TIMING_SOURCE, CheckpointRecord, Event, JobAccount
from service.models import Checkpoint, Job, JobAccountRow, JobEvent
from service.schemas.events import EventIn
from service.settings import Settings

CHECKPOINT_FIELDS = ("started_at", "staged_at", "committed_at", "failed_at", "path", "bytes")


class EventRejected(Exception):
    """One event makes the whole batch unacceptable; `field` is its path in the request."""

    def __init__(self, index: int, field: str, msg: str) -> None:
        super().__init__(msg)
        self.field, self.msg = f"events.{index}.{field}", msg


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity (PostgreSQL refuses them): a diverged loss is stored as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _insert(session: Session):
    return (postgresql if session.get_bind().dialect.name == "postgresql" else sqlite).insert


class _SqlSteps:
    """The engine's StepLookup over the events table (index on job, kind, attempt, step)."""

    def __init__(self, session: Session, job_id: str) -> None:
        self.session, self.job_id = session, job_id

    def steps_above(self, attempt: int, step: int) -> tuple[int, float]:
        count, seconds = self.session.execute(
            select(func.count(), func.coalesce(func.sum(JobEvent.duration), 0.0)).where(
                JobEvent.job_id == self.job_id, JobEvent.kind == "step", JobEvent.attempt == attempt,
                JobEvent.step > step, JobEvent.source == TIMING_SOURCE,
            )  # fmt: skip
        ).one()
        return int(count), float(seconds)


def ingest(
    session: Session,
    batch: Sequence[tuple[str, EventIn]],
    *,
    clock_offset: float = 0.0,
    settings: Settings | None = None,
) -> IngestResult:
    """Stores and accounts a batch of (job id, event); raises EventRejected, leaving the caller
    to roll back. `settings` brings the limits on data size and future times (None: the
    service's own events, trusted). The caller commits."""
    now = time.time()
    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)  # the rows to store, per job
    positions: dict[str, list[int]] = defaultdict(list)  # each row's index in the batch
    first_index: dict[tuple, int] = {}
    duplicates = 0
    for i, (job_id, e) in enumerate(batch):
        data = e.data
        try:
            size = len(json.dumps(data, separators=(",", ":"), allow_nan=False))
        except ValueError:
            data = _finite(data)
            size = len(json.dumps(data, separators=(",", ":")))
        if settings is not None:
            if size > settings.max_event_data_bytes:
                raise EventRejected(i, "data", f"data is over the limit of {settings.max_event_data_bytes} bytes")
            if e.ts + clock_offset > now + settings.max_event_future_seconds:
                ahead = e.ts + clock_offset - now
                msg = f"ts is {ahead:.0f} s ahead of the service's clock (after skew correction)"
                raise EventRejected(i, "ts", msg)
        row = {
            "job_id": job_id, "attempt": e.attempt, "source": e.source, "seq": e.seq, "kind": e.kind,
            "ts": e.ts + clock_offset, "clock_offset_seconds": clock_offset, "step": e.step,
            "duration": float(data["duration"]) if e.kind == "step" else None, "data": data,
        }  # fmt: skip
        key = (job_id, e.attempt, e.source, e.seq)
        if key in first_index:
            earlier = by_job[job_id][first_index[key]]
            if _content(earlier) != _content(row):
                raise EventRejected(i, "seq", _conflict_message(e))
            duplicates += 1
            continue
        first_index[key] = len(by_job[job_id])
        by_job[job_id].append(row)
        positions[job_id].append(i)
    _check_jobs_exist(session, positions)
    accepted = 0
    for job_id in sorted(by_job):  # one lock order for every process: no deadlock between jobs
        new, repeated = _ingest_job(session, job_id, by_job[job_id], positions[job_id])
        accepted, duplicates = accepted + new, duplicates + repeated
    return IngestResult(accepted, duplicates)


def _content(row: dict[str, Any]) -> tuple:
    # The emitter's own time: a repeat sent after the node's offset changed is still a repeat.
    return (row["kind"], round(row["ts"] - row["clock_offset_seconds"], 6), row["step"], row["data"])


def _conflict_message(e: EventIn) -> str:
    return f"seq {e.seq} of {e.source} in attempt {e.attempt} was already sent with other content"


def _check_jobs_exist(session: Session, positions: dict[str, list[int]]) -> None:
    # FOR KEY SHARE (PostgreSQL): the job before its accounting row, in the order the scheduler
    # takes them (it locks jobs, then emits events), so the two never wait on each other in a circle.
    query = select(Job.id).where(Job.id.in_(list(positions))).with_for_update(read=True, key_share=True)
    known = set(session.scalars(query))
    for job_id, indexes in positions.items():
        if job_id not in known:
            raise EventRejected(indexes[0], "job_id", f"no job {job_id}")


def _ingest_job(session: Session, job_id: str, rows: list[dict[str, Any]], positions: list[int]) -> tuple[int, int]:
    insert = _insert(session)
    # Create-if-missing first: on SQLite this write takes the database's write lock at once.
    session.execute(
        insert(JobAccountRow).values(job_id=job_id, account={}, failures=0, events=0).on_conflict_do_nothing()
    )
    account_row = session.scalars(
        select(JobAccountRow).where(JobAccountRow.job_id == job_id).with_for_update().execution_options(
            populate_existing=True
        )
    ).one()
    # Core, not the ORM's bulk path: one multi-row INSERT per page, RETURNING only the new keys.
    events = JobEvent.__table__
    inserted = session.connection().execute(
        insert(events).on_conflict_do_nothing().returning(events.c.attempt, events.c.source, events.c.seq), rows
    ).all()
    if len(inserted) == len(rows):
        new_rows, repeats = rows, 0
    else:
        new_keys = set(map(tuple, inserted))
        fresh = [(r["attempt"], r["source"], r["seq"]) in new_keys for r in rows]
        _check_repeats(session, job_id, [(r, i) for r, i, new in zip(rows, positions, fresh, strict=True) if not new])
        new_rows = [r for r, new in zip(rows, fresh, strict=True) if new]
        repeats = len(rows) - len(new_rows)
    account = JobAccount.from_dict(account_row.account)
    _fold(session, job_id, account, new_rows)
    account.settle(_SqlSteps(session, job_id))
    starts = [a.start for a in account.attempts.values() if a.start is not None]
    account_row.account = account.to_dict()
    account_row.window_start = min(starts) if starts else None
    account_row.finished_at = account.finished_at
    account_row.last_event_at = account.last_event_at
    account_row.failures = sum(a.failed_at is not None for a in account.attempts.values())
    account_row.events += len(new_rows)
    session.flush()
    return len(new_rows), repeats


def _check_repeats(session: Session, job_id: str, repeats: list[tuple[dict[str, Any], int]]) -> None:
    """Each repeat (row, its batch index) must have the stored event's content."""
    keys = [(r["attempt"], r["source"], r["seq"]) for r, _ in repeats]
    existing = {}
    for chunk in range(0, len(keys), 500):
        for row in session.scalars(
            select(JobEvent).where(
                JobEvent.job_id == job_id,
                tuple_(JobEvent.attempt, JobEvent.source, JobEvent.seq).in_(keys[chunk : chunk + 500]),
            )
        ):
            existing[(row.attempt, row.source, row.seq)] = {
                "kind": row.kind, "ts": row.ts, "clock_offset_seconds": row.clock_offset_seconds,
                "step": row.step, "data": row.data,
            }  # fmt: skip
    for (r, index), key in zip(repeats, keys, strict=True):
        if _content(existing[key]) != _content(r):
            raise EventRejected(
                index, "seq", f"seq {r['seq']} of {r['source']} in attempt {r['attempt']} "
                "was already stored with other content"
            )  # fmt: skip


def _fold(session: Session, job_id: str, account: JobAccount, rows: list[dict[str, Any]]) -> None:
    """Applies the new events to the account, and their checkpoint events to the catalog."""
    ckpt_keys = {
        (r["attempt"], r["step"]) for r in rows if r["kind"] in CHECKPOINT_KINDS and r["source"] == TIMING_SOURCE
    }
    records: dict[tuple[int, int], Checkpoint] = {}
    if ckpt_keys:
        for c in session.scalars(
            select(Checkpoint).where(
                Checkpoint.job_id == job_id, tuple_(Checkpoint.attempt, Checkpoint.step).in_(list(ckpt_keys))
            )
        ):
            records[(c.attempt, c.step)] = c
        for key in ckpt_keys - records.keys():
            records[key] = Checkpoint(job_id=job_id, attempt=key[0], step=key[1])
            session.add(records[key])
    for r in rows:
        event = Event(r["kind"], r["ts"], r["attempt"], r["source"], r["seq"], r["step"], r["data"])
        if event.kind not in CHECKPOINT_KINDS or event.source != TIMING_SOURCE:
            account.apply(event)
            continue
        row = records[(r["attempt"], r["step"])]
        record = CheckpointRecord(r["attempt"], r["step"], **{f: getattr(row, f) for f in CHECKPOINT_FIELDS})
        account.apply(event, record)
        for f in CHECKPOINT_FIELDS:
            setattr(row, f, getattr(record, f))


def ingest_trusted(session: Session, job_id: str, events: Sequence[dict[str, Any]]) -> IngestResult:
    """The service's own events (service/timeline.py), inside the caller's transaction."""
    return ingest(session, [(job_id, EventIn.model_validate(e)) for e in events])
