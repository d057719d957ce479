"""A job's notifications (docs/jobspec.md, "notify"): what each of its events owes its webhooks,
recorded in the event's own transaction, and the deliveries' bookkeeping. The sending itself is the
service's background task (service/asgi/background.py, `run_notifier`), off the scheduler's path:
a receiver that is down or slow delays nothing but its own deliveries.

Each delivery is tried until its receiver answers 2xx, with a doubling wait between tries (1 s up
to 5 min), and given up after MAX_TRIES. A service process takes the due deliveries it will send by
moving their next try past a lease (`claim_due`), so two processes never send one at once; its id,
the same on every try, lets a receiver drop the repeat a crash between sending and recording
could cause.
"""

import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.models import Job, JobState
from service.notification_models import DELIVERED, GIVEN_UP, PENDING, Notification
from service.schemas.notify import DELIVERY_HEADER, EVENT_HEADER, SIGNATURE_HEADER

MAX_TRIES = 10
FIRST_RETRY_SECONDS, LONGEST_RETRY_SECONDS = 1.0, 300.0
LEASE_SECONDS = 60.0  # a process that took a delivery and died: another sends it after this
CLAIM_BATCH = 50


def record(session: Session, job: Job, event: str, key: str, attempt: int | None, data: dict[str, Any],
           now: float) -> None:
    """What `event` of `job` (once per `key`) owes each of its webhooks, if it asked for it."""
    notify = job.spec.notify
    if notify is None or event not in notify.events:
        return
    session.flush()  # the job's and its attempts' new state, for the checks below
    for webhook, url in enumerate(notify.webhooks):
        if session.scalar(select(Notification.id).where(Notification.job_id == job.id, Notification.key == key,
                                                        Notification.webhook == webhook)):
            continue  # already owed (an attempt_failed event corrected by its root cause)
        delivery = uuid.uuid4().hex
        body = {"id": delivery, "event": event, "at": datetime.fromtimestamp(now, UTC).isoformat(),
                "job": {"id": job.id, "name": job.name, "owner": job.owner, "state": job.state.value},
                "attempt": attempt, "data": data}  # fmt: skip
        session.add(Notification(id=delivery, job_id=job.id, key=key, event=event, webhook=webhook, url=url,
                                 body=json.dumps(body, sort_keys=True), state=PENDING, next_try_at=now))


def on_service_event(session: Session, job_id: str, attempt: int, kind: str, data: dict[str, Any], now: float) -> None:
    """The notification a service event means, if any (service/jobs/service_events.py)."""
    job = session.get(Job, job_id)
    if job is None or job.spec.notify is None:
        return
    if kind == "attempt_failed":
        record(session, job, "failed", f"failed:{attempt}", attempt, data, now)
    elif kind == "attempt_allocated" and attempt > 0:
        record(session, job, "restarted", f"restarted:{attempt}", attempt, data, now)
    elif kind == "job_finished":
        stopped = data.get("state") == JobState.cancelled.value
        record(session, job, "stopped" if stopped else "finished", "finished", attempt, data, now)


def signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Outgoing:
    id: str
    url: str
    body: bytes
    headers: dict[str, str]


def claim_due(session: Session, now: float) -> list[Outgoing]:
    """Due deliveries this process now sends: each taken with a lease, so no other process does."""
    due = session.execute(select(Notification, Job).join(Job, Job.id == Notification.job_id)
                          .where(Notification.state == PENDING, Notification.next_try_at <= now)
                          .order_by(Notification.next_try_at).limit(CLAIM_BATCH)).all()  # fmt: skip
    taken = []
    for row, job in due:
        claimed = session.execute(update(Notification).where(Notification.id == row.id,
                                                              Notification.next_try_at == row.next_try_at)
                                  .values(next_try_at=now + LEASE_SECONDS)).rowcount  # fmt: skip
        if claimed and job.spec.notify is not None:
            body = row.body.encode()
            headers = {"Content-Type": "application/json", EVENT_HEADER: row.event, DELIVERY_HEADER: row.id,
                       SIGNATURE_HEADER: signature(job.spec.notify.secret, body)}  # fmt: skip
            taken.append(Outgoing(row.id, row.url, body, headers))
    session.commit()
    return taken


def record_outcome(session: Session, delivery: str, error: str | None, now: float) -> None:
    """A try's outcome: delivered (error None), else tried again later, or given up after MAX_TRIES."""
    row = session.get(Notification, delivery)
    if row is None:
        return  # its job was deleted meanwhile
    row.tries += 1
    if error is None:
        row.state, row.delivered_at, row.last_error = DELIVERED, datetime.fromtimestamp(now, UTC), None
        return
    row.last_error = error[:512]
    if row.tries >= MAX_TRIES:
        row.state = GIVEN_UP
    else:
        row.next_try_at = now + min(LONGEST_RETRY_SECONDS, FIRST_RETRY_SECONDS * 2 ** (row.tries - 1))


def of_job(session: Session, job: Job) -> list[Notification]:
    return list(session.scalars(select(Notification).where(Notification.job_id == job.id)
                                .order_by(Notification.created_at, Notification.webhook)))  # fmt: skip
