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
    drained: str | None = None  # why an admin, or its node evidence, took it out of the scheduler's choice
    fenced: str | None = None  # declared lost for an attempt by its peers: no work until its agent stops it


class NodeEvidenceOut(BaseModel):
    """A piece of node evidence (service/agents/node_evidence.py)."""

    kind: str = Field(description="health_check, xid, ecc, oom_kill or node_lost")
    source: str = Field(description="who read it: the agent's health check, its reading of the kernel log, ...")
    detail: str
    seen_at: datetime
    job_id: str | None = Field(None, description="the attempt its agent reported it with, if any")
    attempt: int | None = None
    drained: bool = Field(description="counted in the node's standing drain")


class NodeDetail(NodeOut):
    """A node as an operator sees it (GET /api/v1/nodes, `ett nodes`)."""

    jobs: list[str] = Field(description="the jobs of its active attempts")
    failures: int = Field(description="failures its reports told within ETT_NODE_FAILURE_WINDOW_SECONDS, of any "
                                      "kind: the jobs' own too, which never drain it")
    flags: int = Field(0, description="straggler flags of its ranks within ETT_NODE_FAILURE_WINDOW_SECONDS "
                                      "(never drain it)")
    slow_in_jobs: int = Field(0, description="jobs whose ranks on it were stragglers within "
                                             "ETT_NODE_FAILURE_WINDOW_SECONDS (a rank slow on several nodes, its "
                                             "slowness following it, counts for none)")
    slow: str | None = Field(None, description="why it is named slow: stragglers on it in 2 jobs or more")
    evidence_count: int = Field(0, description="node evidence within ETT_NODE_FAILURE_WINDOW_SECONDS: "
                                               "ETT_NODE_FAILURE_LIMIT of it drains the node")
    evidence: list[NodeEvidenceOut] = Field([], description="its node evidence within the window or counted in "
                                                            "its drain, newest first (10 at most)")


class DrainRequest(Strict):
    reason: Annotated[str, StringConstraints(max_length=256)] | None = None


class HeartbeatReply(BaseModel):
    commands: list[dict[str, Any]]
    server_time: float
