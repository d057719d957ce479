"""The job spec (docs/jobspec.md): what a user submits, checked once at submit, and what the
service reads back from a job's row (service/models.py stores it as this model).
"""

from typing import Annotated, Literal, Self

from pydantic import (
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ett.protocol import FAULT_ACTIONS
from ett.protocol.messages import ModuleName
from service.spec import Strict
from service.spec.notify import NotifySpec

JobName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
OverrideValue = str | int | float | bool
# Variables a job's `env` may not set: they change how the interpreter or the dynamic loader starts
# (a listed entrypoint would run code the entrypoint policy never saw: PYTHONWARNINGS with BROWSER
# ran a shell), how programs are found, or the job's own environment, which the agent sets.
ENV_REFUSED_PREFIXES = ("PYTHON", "LD_", "DYLD_", "ETT_", "MALLOC_")
ENV_REFUSED = frozenset({
    "PATH", "BROWSER", "PERL5OPT", "PERL5LIB", "PERLLIB", "RUBYOPT", "RUBYLIB", "NODE_OPTIONS", "BASH_ENV", "ENV",
    "SHELLOPTS", "IFS", "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
    "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR",
})  # fmt: skip


class TrainerSpec(Strict):
    preset: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "cpu-demo"
    overrides: dict[Annotated[str, StringConstraints(pattern=r"^[a-z_]+(\.[a-z_]+)+$")], OverrideValue] = {}


class CheckpointSpec(Strict):
    interval_steps: Annotated[int, Field(ge=1)] | Literal["auto"] = 50
    keep: Annotated[int, Field(ge=1, le=1000)] = 3
    dir: Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=r"^/")] | None = None
    # Each rank also snapshots its own state on its node's local disk after every step (the fast
    # tier): a restart on the same nodes loses at most a step (docs/trainer.md, "Local snapshots").
    snapshots: bool = False
    # With snapshots on a job of several nodes: how many of the next nodes keep a copy of each
    # rank's snapshot; that many neighbouring nodes may be lost at once (docs/trainer.md).
    snapshot_copies: Annotated[int, Field(ge=1, le=8)] = 1


class FaultSpec(Strict):
    attempt: Annotated[int, Field(ge=0)]
    rank: Annotated[int, Field(ge=0)]
    at_step: Annotated[int, Field(ge=1)]
    # kill, hang, exit, lose_node: by the agent, any job (lose_node only on agents that allow the
    # drill); raise, fill_memory, fill_disk, slow: by the rank's ett.Run as it enters the step.
    action: Literal[FAULT_ACTIONS]
    code: Annotated[int, Field(ge=1, le=255)] | None = None
    exception: Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Za-z]{0,63}$")] | None = None
    message: Annotated[str, StringConstraints(max_length=1024)] | None = None
    path: Annotated[str, StringConstraints(pattern=r"^/", max_length=1024)] | None = None
    factor: Annotated[float, Field(gt=1, le=100)] | None = None  # slow: the rank's steps take this many times longer

    @model_validator(mode="after")
    def _fields_of_the_action(self) -> Self:
        if (self.action == "slow") != (self.factor is not None):
            raise ValueError("factor (above 1) is required for action 'slow' and only for it")
        if (self.action == "exit") != (self.code is not None):
            raise ValueError("code is required for action 'exit' and only for it")
        if self.action != "raise" and (self.exception is not None or self.message is not None):
            raise ValueError("exception and message are for action 'raise' only")
        if (self.action == "fill_disk") != (self.path is not None):
            raise ValueError("path (an absolute folder) is required for action 'fill_disk' and only for it")
        return self


# sbatch options ETT sets itself, or that the fields above set: refused in `slurm.options`.
SBATCH_OWN_OPTIONS = frozenset({
    "nodes", "ntasks", "ntasks-per-node", "job-name", "output", "error", "array", "wrap", "requeue",
    "no-requeue", "exclude", "export", "chdir", "parsable", "partition", "account", "time", "hold",
})  # fmt: skip
# The sbatch options a job may add, by their exact long names: resources, placement, priority and
# notifications. sbatch takes any unambiguous abbreviation (`--outp=` for `--output=`), so a
# deny-list is no bound; what is not here (a file to read or write, another user, a container, an
# environment) is refused.
SBATCH_ALLOWED_OPTIONS = frozenset({
    "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket", "gpu-bind", "gpu-freq", "gres", "gres-flags",
    "cpus-per-task", "cpus-per-gpu", "mem", "mem-per-cpu", "mem-per-gpu", "mem-bind", "tmp", "exclusive",
    "oversubscribe", "overcommit", "constraint", "prefer", "nodelist", "reservation", "qos", "nice", "priority",
    "licenses", "switches", "network", "hint", "distribution", "threads-per-core", "cores-per-socket",
    "sockets-per-node", "core-spec", "thread-spec", "cpu-freq", "signal", "time-min", "begin", "deadline",
    "dependency", "comment", "wckey", "mail-type", "mail-user", "spread-job", "use-min-nodes",
})  # fmt: skip
SLURM_TIME = r"^(\d+-\d{1,2}(:\d{1,2}){0,2}|\d+(:\d{1,2}){0,2})$"
SlurmName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._,-]+$")]


class SlurmSpec(Strict):
    """Run the job in its own Slurm allocation (docs/slurm.md)."""

    partition: SlurmName | None = None
    account: SlurmName | None = None
    # Slurm's forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
    time_limit: Annotated[str, StringConstraints(pattern=SLURM_TIME)] | None = None
    # More sbatch options, each one long option: "--gpus-per-node=8", "--exclusive", "--qos=high"
    options: Annotated[list[Annotated[str, StringConstraints(max_length=512)]], Field(max_length=64)] = []

    @field_validator("options")
    @classmethod
    def _long_options_of_our_own(cls, options: list[str]) -> list[str]:
        for index, option in enumerate(options):
            name = option.removeprefix("--").split("=", 1)[0]
            if not option.startswith("--") or not name or any(c.isspace() for c in option):
                raise ValueError(f"options.{index}: {option!r} is not one long sbatch option (--name or --name=value)")
            if name in SBATCH_OWN_OPTIONS:
                raise ValueError(f"options.{index}: --{name} is set by ETT (or by a field of the slurm section)")
            if name not in SBATCH_ALLOWED_OPTIONS:
                raise ValueError(f"options.{index}: --{name} is not an sbatch option a job may set (their exact long "
                                 "names, no abbreviations: docs/slurm.md)")
        return options


class ElasticSpec(Strict):
    """Run on fewer nodes than `nodes` rather than wait for a spare (docs/jobspec.md, "elastic")."""

    min_nodes: Annotated[int, Field(ge=1, le=4096)]


class JobSpec(Strict):
    name: JobName
    nodes: Annotated[int, Field(ge=1, le=4096)] = 1
    procs_per_node: Annotated[int, Field(ge=1, le=64)] = 1
    trainer: TrainerSpec = TrainerSpec()
    entrypoint: Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1)] | None = None
    max_restarts: Annotated[int, Field(ge=0, le=1000)] = 3
    # Exit codes that mean retrying cannot help: an attempt ending with one fails the job at once.
    # 3 (ETT's configuration error: the trainer's, an agent's refused launch) always is one.
    no_retry_exit_codes: Annotated[list[Annotated[int, Field(ge=1, le=255)]], Field(max_length=255)] = []
    # This many attempts in a row failing alike (the same diagnosis and summary, each resumed from
    # the same checkpoint, none newer committed): the job stops restarting (service/failures/diagnosis.py).
    max_same_failures: Annotated[int, Field(ge=1, le=1000)] = 3
    # A rank its peers keep waiting for (docs/reliability.md, "Stragglers"): report it, or also
    # replace its node when the slowdown would cost more than a restart.
    stragglers: Literal["report", "replace"] = "report"
    checkpoint: CheckpointSpec = CheckpointSpec()
    # null (TOML, which has no null: "off"): no hang detection, neither the init timeout nor this one
    hang_timeout_seconds: Annotated[float, Field(gt=0, le=86400)] | None = 120
    faults: Annotated[list[FaultSpec], Field(max_length=100)] = []
    env: Annotated[dict[EnvName, Annotated[str, StringConstraints(max_length=4096)]], Field(max_length=256)] = {}
    # An entrypoint `python SCRIPT ...`: what its agents' warm server imports once, then forks each
    # restarted rank from (agent/warm/server.py), as the built-in trainer's ranks are.
    warm_imports: Annotated[list[ModuleName], Field(max_length=32)] = []
    # Set: the job runs in an allocation of its own on a Slurm cluster, not on the hand-run agents.
    slurm: SlurmSpec | None = None
    # Webhooks the service calls, signed, on the job's events (docs/jobspec.md, "notify").
    notify: NotifySpec | None = None
    # Set: with no spare free, a failure or an exclusion restarts the job at once on the nodes it
    # has, down to `min_nodes`, at a size its run declared; it grows back when it pays (service/jobs/elastic.py).
    elastic: ElasticSpec | None = None

    @property
    def world_size(self) -> int:
        """Its ranks, numbered 0 to this less one."""
        return self.nodes * self.procs_per_node

    @field_validator("env")
    @classmethod
    def _no_variable_that_changes_how_programs_start(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if name in ENV_REFUSED or name.startswith(ENV_REFUSED_PREFIXES):
                raise ValueError(f"env.{name}: refused: it changes how the interpreter, the loader or the shell "
                                 "starts, or the job's own ETT_ environment (docs/jobspec.md, \"env\")")
        return env

    @field_validator("elastic")
    @classmethod
    def _elastic_within_the_job(cls, elastic: ElasticSpec | None, info: ValidationInfo) -> ElasticSpec | None:
        if elastic is None:
            return elastic
        nodes = info.data.get("nodes")
        if nodes is not None and elastic.min_nodes > nodes:
            raise ValueError(f"elastic.min_nodes: {elastic.min_nodes} is above the job's nodes ({nodes}), its full "
                             "size")
        if info.data.get("slurm") is not None:
            raise ValueError("elastic: a Slurm job runs on its allocation's nodes and is not elastic; leave out one of "
                             "the two")
        return elastic

    @field_validator("hang_timeout_seconds", mode="before")
    @classmethod
    def _off_is_null(cls, value: object) -> object:
        return None if value == "off" else value

    @field_validator("faults")
    @classmethod
    def _faults_target_real_ranks(cls, faults: list[FaultSpec], info: ValidationInfo) -> list[FaultSpec]:
        world = info.data.get("nodes", 1) * info.data.get("procs_per_node", 1)
        for index, fault in enumerate(faults):
            if fault.rank >= world:
                raise ValueError(f"faults.{index}.rank: rank {fault.rank} does not exist in a job of {world} ranks")
        return faults
