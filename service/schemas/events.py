"""Schema-v1 events (docs/events.md) as request bodies, and the ETT reports as answers."""

import math
from typing import Annotated, Any, Literal, NotRequired, Required, get_type_hints

import typing_extensions
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    with_config,
)
from pydantic_core import SchemaValidator

from ett.protocol import AGENT_KINDS, EVENT_KINDS, SERVICE_KINDS
from ett.protocol.event_fields import EVENT_FIELDS
from service.accounting.engine import CATEGORIES
from service.spec import Strict

EventKind = Literal[tuple(sorted(EVENT_KINDS))]  # type: ignore[valid-type]
Source = Annotated[str, StringConstraints(pattern=r"^(rank:\d{1,6}|node:[A-Za-z0-9._-]{1,128}|service)$")]
# Kinds that are about one training step, so they must name it.
STEP_KINDS = frozenset({"step", "restore_end", "ckpt_start", "ckpt_staged", "ckpt_committed", "ckpt_failed"})
MAX_BATCH = 20_000


# A declared number is bounded (#48): the accounting sums and divides them, and a job writes them. An
# int is a count, step, pid or code: 0 to 2**53 (held exactly by every JSON reader, and a BIGINT); a
# float is seconds: 0 to a billion (31 years), finite. A loss is any float: a diverged run's NaN or
# infinity is real, and its step must still count (stored as null, service/ingest/rows.py).
DECLARED_INT_MAX = 2**53
DECLARED_SECONDS_MAX = 1e9
_BOUNDED: dict[Any, Any] = {
    int: Annotated[int, Field(ge=0, le=DECLARED_INT_MAX)],
    float: Annotated[float, Field(ge=0, le=DECLARED_SECONDS_MAX, allow_inf_nan=False)],
    list[int]: list[Annotated[int, Field(ge=0, le=DECLARED_INT_MAX)]],
}


def _data_validator(fields: type) -> SchemaValidator:
    """A kind's fields (ett/protocol/event_fields.py) as pydantic checks them, strictly (no coercion),
    their numbers bounded (above): the same TypedDict, as typing_extensions makes it (pydantic takes no
    `typing.TypedDict` below Python 3.12). Its core validator: 0.3 to 0.4 us for a rank's data, under a
    tenth of an event's check."""
    required = fields.__required_keys__  # type: ignore[attr-defined]
    hints = {name: (Required if name in required else NotRequired)[_BOUNDED.get(hint, hint)]
             for name, hint in get_type_hints(fields).items()}  # fmt: skip
    typed = typing_extensions.TypedDict(fields.__name__, hints)  # type: ignore[operator]
    return TypeAdapter(with_config(ConfigDict(strict=True))(typed)).validator  # type: ignore[return-value]


# Each kind's `data`, checked on its declared fields; others are kept as they are.
DATA_TYPES = {kind: _data_validator(fields) for kind, fields in EVENT_FIELDS.items()}


def _source_prefix(kind: str) -> str:
    if kind in SERVICE_KINDS:
        return "service"
    return "node:" if kind in AGENT_KINDS else "rank:"


class EventIn(Strict):
    kind: EventKind
    ts: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    attempt: Annotated[int, Field(ge=0, le=1_000_000)]
    source: Source
    seq: Annotated[int, Field(ge=0, lt=2**62)]
    step: Annotated[int, Field(ge=0, lt=2**31)] | None = Field(None, validate_default=True)
    data: dict[str, Any] = Field({}, validate_default=True)

    @field_validator("source")
    @classmethod
    def _source_matches_kind(cls, source: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        if kind is not None and not source.startswith(_source_prefix(kind)):
            raise ValueError(f"a {kind} event comes from {_source_prefix(kind).rstrip(':')}, not {source}")
        return source

    @field_validator("step")
    @classmethod
    def _step_named(cls, step: int | None, info: ValidationInfo) -> int | None:
        if step is None and info.data.get("kind") in STEP_KINDS:
            raise ValueError(f"a {info.data['kind']} event must name its step")
        return step

    @field_validator("data")
    @classmethod
    def _data_of_kind(cls, data: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        kind = info.data.get("kind")
        if kind == "step":
            duration = data.get("duration")
            if isinstance(duration, bool) or not isinstance(duration, int | float) or not (0 <= duration < math.inf):
                raise ValueError("a step event needs data.duration: its length in seconds, a number >= 0")
        if data and kind in DATA_TYPES:  # empty: every kind's type takes it (a step's duration is checked above)
            try:
                DATA_TYPES[kind].validate_python(data)
            except ValidationError as error:  # the first wrong field, named as a path under `data`
                first = error.errors(include_url=False)[0]
                path = ".".join(str(part) for part in first["loc"])
                raise ValueError(f"data.{path}: {first['msg']}, for a field of {kind} events") from None
        return data  # as sent: fields no type declares are kept


class AgentEventIn(EventIn):
    job_id: Annotated[str, StringConstraints(min_length=1, max_length=32)]


class EventBatch(Strict):
    events: Annotated[list[EventIn], Field(min_length=1, max_length=MAX_BATCH)]


class AgentEventBatch(Strict):
    events: Annotated[list[AgentEventIn], Field(min_length=1, max_length=MAX_BATCH)]


class IngestOut(BaseModel):
    accepted: int
    duplicates: int
    refused: int = Field(0, description="events past their job's bound (ETT_MAX_EVENTS_PER_RANK), the job then "
                         "stopped, or of an attempt this node was fenced from (declared lost for it): not stored "
                         "and not to be sent again")


Seconds = dict[Literal[CATEGORIES], float]  # type: ignore[valid-type]


class FailureOut(BaseModel):
    attempt: int
    cause: str | None
    detail: str | None = None  # what the scheduler said of it: "rank 1 exit code 1", ...
    # Why, from the evidence (docs/reliability.md, "Failure diagnosis"): exception, out_of_memory, ...
    diagnosis: str | None = None
    summary: str | None = None  # its one line: "ValueError: bad batch", ...
    at: float
    time_to_recover_seconds: float | None
    lost_steps: int


class CheckpointFigures(BaseModel):
    committed: int
    last_committed_step: int | None
    mean_blocking_seconds: float | None
    mean_commit_seconds: float | None


class StragglerOut(BaseModel):
    attempt: int
    rank: int
    node: str
    since_step: int
    flagged_step: int
    relative: float  # its work over its peers' median
    individual: float | None  # its work over its own early in the attempt
    work_seconds: float
    peer_seconds: float
    action: str  # reported, replaced, kept (the policy is `replace`; `reason` says why it went on where it ran)
    reason: str | None = None
    follows_rank: bool = False  # flagged on another node of the job before: the cause is not the node


class SlowdownOut(BaseModel):
    """A lasting change in an attempt's pace (docs/ett.md, "Slow time")."""

    attempt: int
    since_step: int
    last_step: int
    ongoing: bool  # it lasts to the attempt's newest steps
    step_seconds: float  # its mean step
    factor: float  # its mean step over the attempt's ideal step
    slow_seconds: float  # booked as slow
    cause: str  # whole_job (every rank slower alike) or straggler (a rank flagged in the attempt)


class AttemptSizeOut(BaseModel):
    """The nodes an attempt ran on, of the job's full size (docs/ett.md, "Reduced capacity")."""

    attempt: int
    nodes: int | None  # None: its allocation named none (an older event)
    full_nodes: int | None
    reduced_capacity_seconds: float  # its productive seconds x (full - nodes) / full


class EttReport(BaseModel):
    job_id: str
    state: str
    wall_seconds: float
    queued_seconds: float
    ett_percent: float
    seconds: Seconds
    slow_seconds: float  # productive time above the ideal step (docs/ett.md, "Slow time")
    full_speed_percent: float  # ETT% less the slow share
    ideal_step_seconds: float | None  # the latest attempt's ideal step that tells one
    reduced_capacity_seconds: float  # productive seconds short of the full size (docs/ett.md, "Reduced capacity")
    capacity_percent: float  # productive node-seconds over wall x the full size: ETT% less the reduced share
    attempt_sizes: list[AttemptSizeOut] = []
    stragglers: list[StragglerOut] = []
    slowdowns: list[SlowdownOut] = []
    time_to_start_seconds: float | None
    failures: list[FailureOut]
    restarts: int
    last_step: int | None  # the newest step of the latest attempt that made one
    mtbf_seconds: float | None
    checkpoints: CheckpointFigures
    recommended_checkpoint_interval_seconds: float | None


class FleetCheckpointFigures(BaseModel):
    committed: int
    mean_blocking_seconds: float | None


class FleetFigures(BaseModel):
    jobs: int
    wall_seconds: float
    ett_percent: float
    seconds: Seconds
    slow_seconds: float
    full_speed_percent: float
    failures: int
    failure_causes: dict[str, int]  # failures in the window by cause, the most frequent first
    failure_diagnoses: dict[str, int]  # the same by diagnosis (exception, out_of_memory, ...)
    restarts: int
    mtbf_seconds: float | None
    mean_time_to_recover_seconds: float | None
    mean_time_to_start_seconds: float | None
    checkpoints: FleetCheckpointFigures


class FleetJobFigures(FleetFigures):
    name: str


class FleetReport(FleetFigures):
    since: float | None
    until: float
    by_name: dict[str, FleetFigures]
    by_job: dict[str, FleetJobFigures]  # by job id
