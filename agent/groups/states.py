"""A worker group's states and how it ended: what the supervisor, the heartbeats (agent.groups.report_book)
and an agent stopped by Slurm (agent.slurm) read of a group, apart from the group that moves through them
(agent.groups.workers, where the state machine is drawn)."""

import enum
from dataclasses import dataclass


class WorkerState(enum.StrEnum):
    LAUNCHING = "launching"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def is_terminal(self) -> bool:
        return self in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED)

    @property
    def reported(self) -> str:
        """The attempt state the service knows (docs/architecture.md, Heartbeat)."""
        return self.value if self.is_terminal else "running"


@dataclass(frozen=True)
class GroupEnd:
    state: WorkerState
    cause: str | None = None  # exit | signal | hang | time_limit | preempted | terminated
    detail: str = ""
    exit_code: int | None = None
