"""The messages between the service and its agents, typed once for both sides (docs/architecture.md,
"Heartbeat"): the commands a heartbeat's answer carries, which the service builds and the agent
reads, and the attempt reports a heartbeat carries, which the agent builds and the service reads.

A command's unknown fields are ignored rather than refused: a newer service may add fields an
older agent does not need, and a refused command would leave an attempt waiting for nothing. A
report is read strictly: the service is the one that must not guess.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, model_validator

from ett.protocol import FAULT_ACTIONS, IMPORTS_MAX_NAMES, MODULE_NAME_MAX_CHARS, MODULE_NAME_PATTERN, acts_at_import

# Node names and job ids: used in paths, so no "/" and no "..".
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
JobId = Annotated[str, Field(pattern=NAME_PATTERN.pattern)]


def _imported_quietly(name: str) -> str:
    if acts_at_import(name):
        raise ValueError(f"{name} acts when imported (a program, a browser, a print): no warm server imports it")
    return name


ModuleName = Annotated[str, StringConstraints(max_length=MODULE_NAME_MAX_CHARS, pattern=MODULE_NAME_PATTERN),
                       AfterValidator(_imported_quietly)]
_MODULE_NAME = TypeAdapter(ModuleName)


def module_names(names: list[str]) -> list[str]:
    """The names of `names` a warm server may import (ModuleName), the others left out: a list stored
    before a rule was added, or by a service that had none, must not reach a launch."""
    kept = []
    for name in names:
        try:
            kept.append(_MODULE_NAME.validate_python(name))
        except ValueError:
            continue
    return kept
REPORT_DETAIL_CHARS = 512


class Incoming(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Fault(Incoming):
    attempt: int = Field(ge=0)
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)
    action: Literal[FAULT_ACTIONS]
    code: int | None = Field(None, ge=0, le=255)  # only for exit; 1 when not given
    exception: str | None = None  # raise: a built-in exception's name (default RuntimeError)
    message: str | None = None  # raise: its message
    path: str | None = None  # fill_disk: the folder to fill
    factor: float | None = None  # slow: how many times slower the rank's steps run


class TrainerSpec(Incoming):
    preset: str
    overrides: dict[str, Any] = {}


class CheckpointSpec(Incoming):
    interval_steps: int | Literal["auto"] = 50
    keep: int = Field(3, ge=1)
    dir: str | None = None
    # The owner's checkpoint area: `dir` must resolve inside it (agent/confinement/confine.py).
    area: str | None = None
    # Node-local fast folder; the service leaves it out and the agent names its own (agent.groups.supervisor).
    local_dir: str | None = None
    resume_from: str | None = None
    snapshots: bool = False  # the fast tier (ett/snapshots/tier.py), with the agent's local folder
    snapshot_copies: int = Field(1, ge=1)  # peer nodes that keep each snapshot (ett/snapshots/peers.py)


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
    # An elastic job's full size in nodes where this attempt runs on fewer (`nnodes`); None: the same.
    full_nnodes: int | None = Field(None, ge=1)
    master_addr: str
    master_port: int = Field(ge=1, le=65535)
    # Who submitted the job, and the number the service gave that owner: an agent started as root
    # runs the job as its first job uid plus that number (agent/confinement/job_user.py).
    owner: str | None = None
    owner_number: int | None = Field(None, ge=1)
    trainer: TrainerSpec | None = None
    entrypoint: list[str] | None = Field(None, min_length=1)
    env: dict[str, str] = {}
    # Modules a warm server imports before it forks the ranks of `entrypoint` (a `python SCRIPT`):
    # the job's `warm_imports`, else what its first attempt imported (AttemptReport.imports).
    warm_imports: list[str] = []
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
        if self.full_nnodes is not None and self.full_nnodes < self.nnodes:
            raise ValueError(f"full_nnodes {self.full_nnodes} is below nnodes {self.nnodes}")
        return self


class StopCommand(AttemptCommand):
    type: Literal["stop"]
    reason: str = ""
    # SIGKILL at once, no SIGTERM and grace: the attempt is broken (a rank exited, was killed, hung or
    # lost its node), its collectives cannot complete, so no final save can; the next attempt waits for it.
    at_once: bool = False


class IntervalCommand(AttemptCommand):
    """A running attempt's new checkpoint interval (`auto`), for its ranks from `from_step` on."""

    type: Literal["checkpoint_interval"]
    interval_steps: int = Field(ge=1)
    from_step: int = Field(ge=0)


class WarmCommand(Incoming):
    """To a node that may take a running job's next attempt (a spare): start the warm server that
    attempt would fork from, before it is needed (docs/agent.md, "Warm start"). The agent starts it
    as the user it would launch the job as, or not at all."""

    type: Literal["warm"]
    job_id: JobId
    owner: str | None = None
    owner_number: int | None = Field(None, ge=1)
    entrypoint: list[str] | None = Field(None, min_length=1)  # None: the trainer's server
    # The job's warm imports, named or learned (LaunchCommand.warm_imports); none: the base set.
    warm_imports: Annotated[list[ModuleName], Field(max_length=IMPORTS_MAX_NAMES)] = []


Command = Annotated[LaunchCommand | StopCommand | IntervalCommand | WarmCommand, Field(discriminator="type")]
command_adapter: TypeAdapter[LaunchCommand | StopCommand | IntervalCommand | WarmCommand] = TypeAdapter(Command)


# What the agent itself read in the kernel's log (/dev/kmsg) while an attempt ran: records the kernel
# wrote (a job, even one run as root, can write none: the kernel marks a written line as the user's),
# of a kind that tells of the node, never of the job (agent/node/kernel_log.py). The service counts
# them against the node (docs/reliability.md, "Draining a node").
KERNEL_READINGS = ("xid", "ecc", "oom_kill")
KERNEL_READING_CHARS = 240
KERNEL_READINGS_PER_REPORT = 8


class KernelReading(BaseModel):
    """One record of the kernel's log, as the agent read it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Literal[KERNEL_READINGS]
    # `kmsg:SEQUENCE:MICROSECONDS`: the record's own, so the same record told by two attempts is one.
    key: Annotated[str, StringConstraints(min_length=1, max_length=48)]
    text: Annotated[str, StringConstraints(max_length=KERNEL_READING_CHARS)]


class AttemptReport(BaseModel):
    """One attempt on one node, as a heartbeat reports it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    job_id: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    attempt: Annotated[int, Field(ge=0)]
    state: Literal["running", "succeeded", "failed", "stopped"]
    # time_limit, preempted, terminated: the agent got SIGTERM from Slurm (its time limit, a
    # preemption, anything else) or the node's shutdown; the ranks had the grace to checkpoint.
    cause: Literal["exit", "signal", "hang", "time_limit", "preempted", "terminated"] | None = None
    detail: Annotated[str, StringConstraints(max_length=REPORT_DETAIL_CHARS)] | None = None
    exit_code: int | None = None
    # Node evidence the agent read from the kernel while the attempt ran (in its ending report).
    kernel: Annotated[list[KernelReading], Field(max_length=KERNEL_READINGS_PER_REPORT)] = []
    # What the attempt's script imported, as its local rank 0 wrote it (ett/imports.py) and the
    # agent checked it (agent/warm/learned.py), in its ending report: the job's next attempts warm them.
    imports: Annotated[list[ModuleName], Field(max_length=IMPORTS_MAX_NAMES)] = []

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.attempt)
