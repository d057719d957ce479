"""What a job's ranks tell beyond their events: the last part of their output, and the ranks
their peers waited for."""

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.model_base import Base, utcnow


class RankLog(Base):
    """The last part of one rank's output in one attempt, as its node's agent shipped it
    (service/jobs/logs.py): `text` holds the stream's characters from `end - len(text)` to `end`."""

    __tablename__ = "rank_logs"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "rank"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    rank: Mapped[int]
    node: Mapped[str] = mapped_column(String(128))
    text: Mapped[str] = mapped_column(Text, default="")
    end: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class StragglerFlag(Base):
    """A rank its peers waited for, found in an attempt's step timings (service/jobs/stragglers.py)."""

    __tablename__ = "stragglers"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "rank"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    rank: Mapped[int]
    node: Mapped[str] = mapped_column(String(128), index=True)
    since_step: Mapped[int]  # the last step of the first window it was slow in
    flagged_step: Mapped[int]  # the last step of the window that confirmed it
    relative: Mapped[float]  # its work over its peers' median, in that window
    individual: Mapped[float | None]  # its work over its own, early in the attempt
    work_seconds: Mapped[float]
    peer_seconds: Mapped[float]
    # reported, or replaced (the policy stopped the attempt to restart without its node)
    action: Mapped[str] = mapped_column(String(16), default="reported")
    flagged_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
