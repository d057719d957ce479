"""Agent registration and heartbeats (docs/architecture.md)."""

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from service.models import NodeState
from service.schemas import Strict

NodeName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]


class AgentRegister(Strict):
    name: NodeName
    address: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    slots: Annotated[int, Field(ge=1, le=1024)]


class AttemptReport(Strict):
    job_id: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    attempt: Annotated[int, Field(ge=0)]
    state: Literal["running", "succeeded", "failed", "stopped"]
    # time_limit, preempted, terminated: the agent got SIGTERM from Slurm (its time limit, a
    # preemption, anything else) or the node's shutdown; the ranks had the grace to checkpoint.
    cause: Literal["exit", "signal", "hang", "time_limit", "preempted", "terminated"] | None = None
    detail: Annotated[str, StringConstraints(max_length=512)] | None = None
    exit_code: int | None = None


class Heartbeat(Strict):
    clock: float
    attempts: Annotated[list[AttemptReport], Field(max_length=64)] = []
    stats: Annotated[dict[str, int | float], Field(max_length=64)] = {}
    # The agent is stopping (it got SIGTERM): its node takes no new work from now on.
    leaving: bool = False


class NodeOut(BaseModel):
    name: str
    address: str
    slots: int
    state: NodeState
    last_heartbeat_at: datetime
    clock_offset_seconds: float
    clock_skew_flagged: bool
    job_id: str | None  # the one job it serves (a Slurm allocation's agent); None: any


class HeartbeatReply(BaseModel):
    commands: list[dict[str, Any]]
    server_time: float
