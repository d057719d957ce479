"""Agent registration and heartbeats (docs/architecture.md)."""

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from ett.protocol.messages import NAME_PATTERN, AttemptReport
from service.models import NodeState
from service.spec import Strict

NodeName = Annotated[str, StringConstraints(pattern=NAME_PATTERN.pattern)]


class AgentRegister(Strict):
    name: NodeName
    address: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    slots: Annotated[int, Field(ge=1, le=1024)]
    # Why the node's health check fails (agent/node/health.py); None: it passes, or the node has none.
    health: Annotated[str, StringConstraints(max_length=512)] | None = None


class Heartbeat(Strict):
    clock: float
    attempts: Annotated[list[AttemptReport], Field(max_length=64)] = []
    stats: Annotated[dict[str, int | float], Field(max_length=64)] = {}
    # The agent is stopping (it got SIGTERM): its node takes no new work from now on.
    leaving: bool = False
    health: Annotated[str, StringConstraints(max_length=512)] | None = None


class NodeOut(BaseModel):
    name: str
    address: str
    slots: int
    state: NodeState
    last_heartbeat_at: datetime
    clock_offset_seconds: float
    clock_skew_flagged: bool
    job_id: str | None  # the one job it serves (a Slurm allocation's agent); None: any
    health: str | None = None  # why its health check fails
    drained: str | None = None  # why an admin, or its failures, took it out of the scheduler's choice


class NodeDetail(NodeOut):
    """A node as an operator sees it (GET /api/v1/nodes, `ett nodes`)."""

    jobs: list[str] = Field(description="the jobs of its active attempts")
    failures: int = Field(description="failures its reports told within ETT_NODE_FAILURE_WINDOW_SECONDS")
    flags: int = Field(0, description="straggler flags of its ranks within ETT_NODE_FAILURE_WINDOW_SECONDS")


class DrainRequest(Strict):
    reason: Annotated[str, StringConstraints(max_length=256)] | None = None


class HeartbeatReply(BaseModel):
    commands: list[dict[str, Any]]
    server_time: float
