"""A job's notifications (docs/jobspec.md, "notify"): the webhooks the service calls on the job's
events, and what a receiver is sent. Named once here: the receivers see these names."""

import ipaddress
from datetime import datetime
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, Field, FieldSerializationInfo, StringConstraints, field_serializer

from service.schemas import Strict

NotifyEvent = Literal["failed", "restarted", "straggler", "finished", "stopped"]
NOTIFY_EVENTS: tuple[str, ...] = get_args(NotifyEvent)
# The headers of each delivery: the event, its id (the same on every try: a receiver drops repeats
# by it) and the body's HMAC-SHA256 under the job's secret, as "sha256=<hex>".
EVENT_HEADER = "X-ETT-Event"
DELIVERY_HEADER = "X-ETT-Delivery"
SIGNATURE_HEADER = "X-ETT-Signature-256"
HIDDEN = "********"
REVEAL = {"secrets": True}  # the serialization context that writes the secret itself (the database's)


def _webhook(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http or https URL")
    try:
        address = ipaddress.ip_address(parts.hostname)
    except ValueError:
        return url  # a name: the operator may allow-list hosts (ETT_NOTIFY_HOSTS)
    if address.is_link_local or address.is_multicast or address.is_unspecified:
        raise ValueError(f"{url!r}: {address} is not an address a webhook may have (link-local: the cloud's "
                         "metadata service)")
    return url


WebhookUrl = Annotated[str, StringConstraints(min_length=1, max_length=2048), AfterValidator(_webhook)]


class NotifySpec(Strict):
    webhooks: Annotated[list[WebhookUrl], Field(min_length=1, max_length=5)]
    events: Annotated[list[NotifyEvent], Field(min_length=1, max_length=len(NOTIFY_EVENTS))] = list(NOTIFY_EVENTS)
    # The key of each delivery's signature: only the job's owner and the receivers know it. The API
    # shows it hidden; only the database's copy holds it.
    secret: Annotated[str, StringConstraints(min_length=16, max_length=256)] = Field(repr=False)

    @field_serializer("secret")
    def _hidden(self, secret: str, info: FieldSerializationInfo) -> str:
        return secret if isinstance(info.context, dict) and info.context.get("secrets") else HIDDEN


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


def revealed(model: Any) -> dict[str, Any]:
    """A model dumped with its secrets, for the database."""
    return model.model_dump(mode="json", context=REVEAL)
