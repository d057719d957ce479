"""Agent registration and heartbeats (docs/architecture.md)."""

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from ett.protocol.messages import NAME_PATTERN, AttemptReport
from service.models import NodeState
from service.schemas import Strict

NodeName = Annotated[str, StringConstraints(pattern=NAME_PATTERN.pattern)]


class AgentRegister(Strict):
    name: NodeName
    address: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    slots: Annotated[int, Field(ge=1, le=1024)]


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
