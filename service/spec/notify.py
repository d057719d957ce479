"""A job's notifications as its spec asks for them (docs/jobspec.md, "notify"): the webhooks the
service calls on which of the job's events, and the key that signs each delivery. What a receiver
is sent, and what the owner reads back, are the API's: service/schemas/notify.py."""

import ipaddress
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, FieldSerializationInfo, StringConstraints, field_serializer

from service.spec import Strict

NotifyEvent = Literal["failed", "restarted", "straggler", "finished", "stopped"]
NOTIFY_EVENTS: tuple[str, ...] = get_args(NotifyEvent)
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


def revealed(model: Any) -> dict[str, Any]:
    """A model dumped with its secrets, for the database."""
    return model.model_dump(mode="json", context=REVEAL)
