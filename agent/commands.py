"""The commands a heartbeat answer carries (docs/architecture.md, "Heartbeat").

Unknown fields are ignored rather than refused: a newer service may add fields an older agent
does not need, and a refused command would leave an attempt waiting for nothing.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from agent.settings import NAME_PATTERN

JobId = Annotated[str, Field(pattern=NAME_PATTERN.pattern)]  # used in paths: no "/" or ".."


class Incoming(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Fault(Incoming):
    attempt: int = Field(ge=0)
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)
    action: Literal["kill", "hang", "exit"]
    code: int | None = Field(None, ge=0, le=255)  # only for exit; 1 when not given


class TrainerSpec(Incoming):
    preset: str
    overrides: dict[str, Any] = {}


class CheckpointSpec(Incoming):
    interval_steps: int | Literal["auto"] = 50
    keep: int = Field(3, ge=1)
    dir: str | None = None
    # The owner's checkpoint area: `dir` must resolve inside it (agent/confine.py).
    area: str | None = None
    # Node-local fast folder; the service leaves it out and the agent names its own (agent.supervisor).
    local_dir: str | None = None
    resume_from: str | None = None
    snapshots: bool = False  # the fast tier (ett/snapshots.py), with the agent's local folder


class AttemptCommand(Incoming):
    """A command about one attempt of a job."""

    job_id: JobId
    attempt: int = Field(ge=0)

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.attempt)


class LaunchCommand(AttemptCommand):
    type: Literal["launch"]
    node_rank: int = Field(ge=0)
    nnodes: int = Field(ge=1)
    nproc_per_node: int = Field(ge=1)
    master_addr: str
    master_port: int = Field(ge=1, le=65535)
    trainer: TrainerSpec | None = None
    entrypoint: list[str] | None = Field(None, min_length=1)
    env: dict[str, str] = {}
    checkpoint: CheckpointSpec = CheckpointSpec()
    hang_timeout_seconds: float | None = Field(120.0, gt=0)  # None: no hang detection
    init_timeout_seconds: float = Field(600.0, gt=0)
    faults: list[Fault] = []

    @model_validator(mode="after")
    def _one_program(self) -> "LaunchCommand":
        if self.trainer is None and self.entrypoint is None:
            raise ValueError("a launch names a trainer or an entrypoint (which wins when both are given)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not below nnodes {self.nnodes}")
        return self


class StopCommand(AttemptCommand):
    type: Literal["stop"]
    reason: str = ""


class IntervalCommand(AttemptCommand):
    """A running attempt's new checkpoint interval (`auto`), for its ranks from `from_step` on."""

    type: Literal["checkpoint_interval"]
    interval_steps: int = Field(ge=1)
    from_step: int = Field(ge=0)


Command = Annotated[LaunchCommand | StopCommand | IntervalCommand, Field(discriminator="type")]
command_adapter: TypeAdapter[LaunchCommand | StopCommand | IntervalCommand] = TypeAdapter(Command)
