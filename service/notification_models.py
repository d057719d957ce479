"""The notifications a job's events owe its webhooks (service/webhooks/notifications.py): a row per
event and webhook, written in the transaction of the event itself and kept until delivered or
given up, so a restart of the service loses none and none is sent twice by two processes."""

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.model_base import Base, utcnow

PENDING, DELIVERED, GIVEN_UP = "pending", "delivered", "given_up"


class Notification(Base):
    __tablename__ = "notifications"
    __table_args__ = (UniqueConstraint("job_id", "key", "webhook"),
                      Index("ix_notifications_due", "state", "next_try_at"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # the delivery id its receiver sees
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(64))  # what happened, once: "failed:3", "straggler:2:1", "finished"
    event: Mapped[str] = mapped_column(String(16))
    webhook: Mapped[int]  # its place in the spec's `notify.webhooks`
    url: Mapped[str] = mapped_column(String(2048))
    body: Mapped[str] = mapped_column(Text)  # the JSON sent, the same on every try
    state: Mapped[str] = mapped_column(String(16), default=PENDING)
    tries: Mapped[int] = mapped_column(default=0)
    next_try_at: Mapped[float]  # epoch seconds; also the lease of the process that took it
    last_error: Mapped[str | None] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None]
