"""What a job's ranks tell beyond their events: the last part of their output, and the ranks
their peers waited for; and what tells of a node itself, its evidence."""

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.model_base import Base, utcnow


class RankLog(Base):
    """The last part of one rank's output in one attempt, as its node's agent shipped it
    (service/ingest/logs.py): `text` holds the stream's characters from `end - len(text)` to `end`."""

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
    """A rank its peers waited for, found in an attempt's step timings (service/stragglers/)."""

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
    # reported; replaced (the policy stopped the attempt to restart without its node); kept (the
    # policy is `replace`, and `reason` says why the attempt went on where it ran)
    action: Mapped[str] = mapped_column(String(16), default="reported")
    reason: Mapped[str | None] = mapped_column(String(512), default=None)
    # Flagged on another node of the job before: the slowness follows the rank, not the node.
    follows_rank: Mapped[bool] = mapped_column(default=False)
    flagged_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class NodeEvidence(Base):
    """Something that tells of a node itself, never of a job (service/agents/node_evidence.py): its
    agent's health check failing, a record the agent read in the kernel's log, its heartbeats gone."""

    __tablename__ = "node_evidence"
    __table_args__ = (UniqueConstraint("node_id", "key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # health_check, xid, ecc, oom_kill, node_lost
    source: Mapped[str] = mapped_column(String(64))  # who read it: the agent's health check, its kernel log, ...
    detail: Mapped[str] = mapped_column(String(256))
    # The kernel record's own key (the same record told by two attempts is one); None: no such key.
    key: Mapped[str | None] = mapped_column(String(48), default=None)
    job_id: Mapped[str | None] = mapped_column(String(32), default=None)  # the attempt that ran meanwhile, if any
    attempt: Mapped[int | None] = mapped_column(default=None)
    seen_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    drained: Mapped[bool] = mapped_column(default=False)  # counted in the node's standing drain
