"""What a job's notifications send and show (docs/jobspec.md, "notify"): the headers of a delivery,
named once here (the receivers see these names), and a delivery as its owner reads it back. The
notify section of the spec itself is stored with the job: service/spec/notify.py."""

from datetime import datetime
from typing import Literal

from pydantic import BaseModel

from service.spec.notify import NotifyEvent

# The headers of each delivery: the event, its id (the same on every try: a receiver drops repeats
# by it) and the body's HMAC-SHA256 under the job's secret, as "sha256=<hex>".
EVENT_HEADER = "X-ETT-Event"
DELIVERY_HEADER = "X-ETT-Delivery"
SIGNATURE_HEADER = "X-ETT-Signature-256"


class NotificationOut(BaseModel):
    """One delivery, as its job's owner sees it (GET /api/v1/jobs/{id}/notifications)."""

    id: str
    event: NotifyEvent
    url: str
    state: Literal["pending", "delivered", "given_up"]
    tries: int
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None
