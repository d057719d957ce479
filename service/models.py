"""SQLAlchemy 2.0 typed models: the service's whole state."""

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
    text,
)  # fmt: skip
from sqlalchemy.orm import Mapped, mapped_column, relationship, validates

from service.column_types import UTCDateTime  # noqa: F401 (the migrations name it service.models.UTCDateTime)
from service.evidence_models import NodeEvidence, RankLog, StragglerFlag  # noqa: F401 (every table is imported from here)
from service.model_base import Base, enum_column, utc_at, utcnow  # noqa: F401 (utc_at: imported from here)
from service.notification_models import Notification  # noqa: F401 (every table is imported from here)
from service.spec.job_spec import JobSpec
from service.states import (  # noqa: F401 (the states are the models' vocabulary: imported from here)
    ACTIVE_ATTEMPT_STATES,
    BROKEN_CAUSES,
    AttemptState,
    JobState,
    NodeState,
    Role,
    SlurmState,
)


class Token(Base):
    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    subject: Mapped[str] = mapped_column(String(128))
    role: Mapped[Role] = mapped_column(enum_column(Role))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked: Mapped[bool] = mapped_column(default=False)
    expires_at: Mapped[datetime | None] = mapped_column(default=None)  # None: never
    # An agent token of one job's Slurm allocation: its nodes serve that job only (Node.job_id).
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), default=None)


class Node(Base):
    """An agent: one per machine."""

    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    address: Mapped[str] = mapped_column(String(255))
    slots: Mapped[int] = mapped_column(Integer)
    state: Mapped[NodeState] = mapped_column(enum_column(NodeState), default=NodeState.idle, index=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("tokens.id"))
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Service clock minus agent clock, measured at the last heartbeat.
    clock_offset_seconds: Mapped[float] = mapped_column(default=0.0)
    clock_skew_flagged: Mapped[bool] = mapped_column(default=False)
    stats: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Why its agent's health check fails (None: it passes): no new work meanwhile.
    health: Mapped[str | None] = mapped_column(String(512), default=None)
    # Why it takes no new work until an admin returns it (`ett nodes drain`, or its failures).
    drained: Mapped[str | None] = mapped_column(String(512), default=None)
    # The one job this node serves (an agent of that job's Slurm allocation); None: any job.
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), default=None, index=True)
    # Why it takes no new work until its agent shows it runs nothing of the attempt it was declared
    # lost for (service/jobs/peer_loss.py, "fencing"); None: not fenced.
    fenced: Mapped[str | None] = mapped_column(String(512), default=None)
    # The job whose straggler's replacement holds this spare (state `reserved`, service/stragglers/spares.py).
    reserved_for: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"), default=None)


class Owner(Base):
    """A job owner (a token's subject), numbered once and for good: agents run its jobs as their
    first job uid plus this number, the same on every node (docs/agent.md, "The job's user")."""

    __tablename__ = "owners"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    state: Mapped[JobState] = mapped_column(enum_column(JobState), default=JobState.queued, index=True)
    spec: Mapped[JobSpec]
    submitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    restarts: Mapped[int] = mapped_column(default=0)
    # Why a job ended in failed or cancelled, for people.
    reason: Mapped[str | None] = mapped_column(String(512))
    # What its script's first attempt imported (AttemptReport.imports), where its spec names no
    # `warm_imports`: its next launches' warm imports. Thousands of names: loaded only when read.
    learned_imports: Mapped[list[str] | None] = mapped_column(JSON, deferred=True)

    attempts: Mapped[list["Attempt"]] = relationship(
        back_populates="job", order_by="Attempt.number", cascade="all, delete-orphan"
    )
    slurm_allocations: Mapped[list["SlurmAllocation"]] = relationship(
        back_populates="job", order_by="SlurmAllocation.number", cascade="all, delete-orphan"
    )

    @validates("spec")
    def _typed(self, _key: str, spec: JobSpec | dict[str, Any]) -> JobSpec:
        """A spec given as a dict (a test, a tool) is checked and typed as it is set."""
        return spec if isinstance(spec, JobSpec) else JobSpec.model_validate(spec)


# A job's number of ranks (JobSpec.world_size: nodes x procs_per_node), read in SQL with its id.
JOB_WORLD_SIZE = (Job.spec["nodes"].as_integer() * Job.spec["procs_per_node"].as_integer()).label("world")


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int]
    state: Mapped[AttemptState] = mapped_column(enum_column(AttemptState), default=AttemptState.allocated)
    allocated_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    cause: Mapped[str | None] = mapped_column(String(16))
    detail: Mapped[str | None] = mapped_column(String(512))
    # Why it failed, from the evidence (service/failures/diagnosis.py): e.g. exception, "ValueError: bad batch".
    diagnosis: Mapped[str | None] = mapped_column(String(32))
    summary: Mapped[str | None] = mapped_column(String(256))
    failed_node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id"), default=None)  # whose report tells
    master_addr: Mapped[str] = mapped_column(String(255))
    master_port: Mapped[int]
    resume_from: Mapped[str | None] = mapped_column(String(1024))
    # The checkpoint interval last given to its ranks: at launch, then each `auto` retune.
    interval_steps: Mapped[int | None]
    # Sequence number of the last event the service emitted for this attempt.
    service_seq: Mapped[int] = mapped_column(default=0)
    # An elastic job's full size in nodes where this attempt runs on fewer (service/jobs/elastic.py),
    # and the largest size it was weighed growing back to (each size is weighed once).
    full_nodes: Mapped[int | None] = mapped_column(default=None)
    grow_weighed: Mapped[int | None] = mapped_column(default=None)

    job: Mapped[Job] = relationship(back_populates="attempts")
    nodes: Mapped[list["AttemptNode"]] = relationship(
        back_populates="attempt", order_by="AttemptNode.node_rank", cascade="all, delete-orphan"
    )


class AttemptNode(Base):
    """One node's share of an attempt: its node rank and what its agent last reported."""

    __tablename__ = "attempt_nodes"
    __table_args__ = (UniqueConstraint("attempt_id", "node_rank"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), index=True)
    node_rank: Mapped[int]
    state: Mapped[AttemptState] = mapped_column(enum_column(AttemptState), default=AttemptState.allocated)
    # When its node was declared lost for this attempt by its peers' evidence (service/jobs/peer_loss.py):
    # what the node sends of this attempt from then on is refused.
    fenced_at: Mapped[datetime | None] = mapped_column(default=None)

    attempt: Mapped[Attempt] = relationship(back_populates="nodes")
    node: Mapped[Node] = relationship()


class SlurmAllocation(Base):
    """One batch job submitted to Slurm for an ETT job (service/slurm/); one live at a time."""

    __tablename__ = "slurm_allocations"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int]  # 0, 1, ...: the job's allocations in order
    slurm_job_id: Mapped[str] = mapped_column(String(32))
    state: Mapped[SlurmState] = mapped_column(enum_column(SlurmState), default=SlurmState.submitted, index=True)
    # What Slurm last said: its state (PENDING, RUNNING, TIMEOUT, ...), its reason, its nodes.
    slurm_state: Mapped[str] = mapped_column(String(32), default="PENDING")
    slurm_reason: Mapped[str | None] = mapped_column(String(256))
    slurm_nodes: Mapped[list[str]] = mapped_column(JSON, default=list)
    bad_nodes: Mapped[list[str]] = mapped_column(JSON, default=list)  # its agents lost: later ones exclude them
    token_id: Mapped[int] = mapped_column(ForeignKey("tokens.id"))
    submitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]

    job: Mapped[Job] = relationship(back_populates="slurm_allocations")


class AgentCommand(Base):
    """A command waiting for (or already handed to) one agent."""

    __tablename__ = "agent_commands"

    id: Mapped[int] = mapped_column(primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), index=True)
    payload: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(index=True)


# ---- ETT: events, checkpoints and per-job accounting (service/ingest/store.py, service/accounting/) ----
# Times here are unix seconds on the service's clock (UTC), as in the events themselves.


# The rows of rank 0's step events (TIMING_SOURCE in service/accounting/engine.py), as a literal SQL
# condition: a partial index serves only queries that state its condition in the same words.
RANK0_STEPS = text("kind = 'step' AND source = 'rank:0'")
STEP_TIMINGS = text("kind = 'step_timing'")  # every rank's windows (service/stragglers/)
ELASTIC_SIZES = text("kind = 'elastic'")  # the sizes a job's run declared (service/jobs/elastic.py)


class JobEvent(Base):
    """One schema-v1 event, kept once per (job, attempt, source, seq)."""

    __tablename__ = "events"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "source", "seq"),
        # Rolled-back step time is summed over (job, attempt, step) ranges of rank 0's steps: an
        # index of those rows alone, so the other events (most of a big job's) update one index less.
        Index("ix_events_rank0_steps", "job_id", "attempt", "step", postgresql_where=RANK0_STEPS,
              sqlite_where=RANK0_STEPS),  # fmt: skip
        Index("ix_events_step_timings", "job_id", "attempt", "step", postgresql_where=STEP_TIMINGS,
              sqlite_where=STEP_TIMINGS),  # fmt: skip
        Index("ix_events_elastic", "job_id", postgresql_where=ELASTIC_SIZES, sqlite_where=ELASTIC_SIZES),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    source: Mapped[str] = mapped_column(String(160))
    seq: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(32))
    ts: Mapped[float]
    # Added to the emitter's ts to get `ts`: the node's measured clock offset (0 for replays).
    clock_offset_seconds: Mapped[float] = mapped_column(default=0.0)
    step: Mapped[int | None]
    duration: Mapped[float | None]  # data.duration of `step` events, summed by the rollback lookup
    data: Mapped[dict[str, Any]]


class Checkpoint(Base):
    """A checkpoint's life (ckpt_start, _staged, _committed, _failed); committed ones are the
    catalog the scheduler resumes from."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    step: Mapped[int]
    started_at: Mapped[float | None]
    staged_at: Mapped[float | None]
    committed_at: Mapped[float | None]
    failed_at: Mapped[float | None]
    path: Mapped[str | None] = mapped_column(String(1024))
    bytes: Mapped[int | None] = mapped_column(BigInteger)


class JobAccountRow(Base):
    """A job's ETT accounting state (service.accounting.engine.JobAccount), kept up to date by ingestion
    so a report reads one row. The columns beside it serve fleet-wide queries."""

    __tablename__ = "ett_accounts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    account: Mapped[dict[str, Any]]
    window_start: Mapped[float | None]
    finished_at: Mapped[float | None]
    last_event_at: Mapped[float | None]
    failures: Mapped[int] = mapped_column(default=0)
    events: Mapped[int] = mapped_column(BigInteger, default=0)
