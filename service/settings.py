"""The service's one validated configuration, read from ETT_* environment variables."""

import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ett.protocol import DEFAULT_SERVICE_PORT

# Agent settings a Slurm allocation's agents may not be given (docs/slurm.md, "Who runs what"):
# the service sets the token's file itself, and the secret would be in the batch script, which
# Slurm keeps and shows; one user for every job would put every owner's jobs in one account.
SLURM_AGENT_ENV_REFUSED = {
    "ETT_AGENT_TOKEN": "the service hands each allocation its own token, in a file",
    "ETT_AGENT_TOKEN_FILE": "the service hands each allocation its own token, in a file",
    "ETT_AGENT_JOB_USER": "an allocation's agents run each owner's jobs as a uid of that owner's",
    "ETT_AGENT_ALLOW_ROOT_JOBS": "an allocation's agents run each owner's jobs as a uid of that owner's",
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ETT_", extra="ignore")

    data_dir: Path = Path("data")
    # Empty means a SQLite file in data_dir; PostgreSQL is given by URL
    # (postgresql+psycopg://user:pass@host/db).
    database_url: str = ""
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_SERVICE_PORT, ge=1, le=65535)  # where the commands and agents look for it
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # Requests a second per bearer token (per client address without one), in bursts of up to
    # rate_limit_burst; over it: 429 with Retry-After. 0 turns it off. An agent needs under 1/s.
    rate_limit_per_second: float = Field(50.0, ge=0)
    rate_limit_burst: int = Field(200, ge=1)
    # Agents whose heartbeats stop for this long are declared lost: the deadline for a node that goes
    # quiet with nothing to tell on it (a node whose peers saw it go is lost sooner, below).
    heartbeat_timeout_seconds: float = Field(30.0, gt=0)
    # A node lost to its peers (docs/reliability.md, "Node loss"): once a node's ranks failed because
    # they lost their connection to a peer (or to the rendezvous store), the attempt's nodes still
    # running are sent its stop. A live agent has it at once (its heartbeat long-polls, answered as the
    # stop is queued, and it heartbeats again as soon as a command came: a round trip, where its
    # heartbeat period is ETT_AGENT_HEARTBEAT_WAIT_SECONDS, 3 s), so a node that sends no heartbeat
    # for this long after is lost for that job, fenced and replaced, not waited for until the deadline.
    # Raise it for agents that do not long-poll (ETT_AGENT_HEARTBEAT_WAIT_SECONDS=0) or a service
    # whose heartbeat writes lag behind by more.
    peer_loss_silence_seconds: float = Field(1.0, gt=0)
    # The next attempt need not wait that long where it has spares: once a node the survivor's text
    # implicates has sent nothing for this long, the next attempt starts on a spare in its place (the
    # silence window above still decides whether it is lost and fenced). A node whose own ranks failed
    # reports within it (its agent sees them end as its peers do).
    peer_loss_grace_seconds: float = Field(0.3, ge=0)
    # Longest a heartbeat may wait for a command (long-poll).
    max_heartbeat_wait_seconds: float = Field(10.0, ge=0)
    # An agent clock further off than this is flagged in the node's state.
    max_clock_skew_seconds: float = Field(5.0, gt=0)
    # A clock offset sample this much above the current estimate is a real clock change, not delay.
    clock_resync_seconds: float = Field(0.5, gt=0)
    # How often the scheduler looks for work it has not been woken for (lost nodes, backoffs).
    scheduler_period_seconds: float = Field(0.5, gt=0)
    # Pause between a failed attempt and the next one, so a crash loop does not spin; an attempt
    # that committed a checkpoint made progress and is restarted without it.
    restart_backoff_seconds: float = Field(1.0, ge=0)
    # How long the surviving nodes of a failed attempt get to stop before their share is given up.
    stop_grace_seconds: float = Field(30.0, gt=0)
    # Limit for a rank's start-up (before its first step) given to agents for hang detection.
    init_timeout_seconds: float = Field(600.0, gt=0)
    # `interval_steps: "auto"` uses the job's failure rate, else the fleet's; with no failure
    # anywhere yet, this mean time between failures.
    assumed_mtbf_seconds: float = Field(86400.0, gt=0)
    # torchrun rendezvous ports are chosen from this range, unused by live attempts on the master node.
    master_port_first: int = Field(29500, ge=1024, le=65000)
    master_port_count: int = Field(500, ge=1, le=10000)
    # Events: an event's `data` over this many bytes (as JSON) is refused, and so is an event
    # dated further than this ahead of the service's clock (after the node's skew correction).
    max_event_data_bytes: int = Field(16 * 1024, ge=256)
    max_event_future_seconds: float = Field(300.0, ge=0)
    # A job stores at most this many events for each of its ranks (nodes x procs_per_node), all its
    # attempts together: past it, its events are refused and the job is stopped, with this for
    # reason (service/ingest/bound.py). Rank 0 sends a `step` event a step and every rank a
    # `step_timing` every 5: about 1.2 million for a million steps of a one-rank job.
    max_events_per_rank: int = Field(2_000_000, ge=1)
    # /metrics exports per-job series for running jobs and jobs finished this recently.
    metrics_recent_seconds: float = Field(3600.0, ge=0)
    # Who may submit a job with an `entrypoint` (its own program): "any" user, "admins" only, or
    # "listed": only programs whose argv starts as one of `allowed_entrypoints` (each a command
    # line, split like a shell's: "python examples/plain_ddp.py"). Jobs of the built-in trainer
    # are always allowed.
    entrypoint_policy: Literal["any", "admins", "listed"] = "any"
    allowed_entrypoints: list[str] = []
    # Each owner's jobs checkpoint under <checkpoint_root>/<owner>/: by default in
    # <owner>/<job id>, or in a folder the job names, which must lie inside that owner's area.
    checkpoint_root: Path | None = None
    # Slurm (docs/slurm.md): jobs with a `slurm` section are submitted with `sbatch`; each gets its
    # own allocation whose steps start `ett agent`s bound to it. Off: such jobs are refused.
    slurm: bool = False
    # Where each allocation's batch script, agent token and Slurm output go: a folder the Slurm
    # nodes see at the same path (shared storage). Default: <data_dir>/slurm.
    slurm_dir: Path | None = None
    # The service's URL as the Slurm nodes reach it (what their agents call). Default: this
    # service's host and port, which serves only a cluster on this machine.
    slurm_service_url: str | None = None
    # The command that starts an agent on a Slurm node, split like a shell's. Default: this
    # service's interpreter running `ett agent`.
    slurm_agent_command: str | None = None
    # Settings given to those agents (ETT_AGENT_JOB_PYTHON, ETT_AGENT_STOP_GRACE_SECONDS, ...):
    # a JSON object of names and values, none of SLURM_AGENT_ENV_REFUSED.
    slurm_agent_env: dict[str, str] = {}
    # Job notifications (docs/jobspec.md, "notify"): the longest a webhook may take to answer one
    # delivery, and the hosts webhooks may be on (empty: any host, but never a link-local address).
    notify_timeout_seconds: float = Field(10.0, gt=0, le=60)
    notify_hosts: list[str] = []
    # How often the service asks Slurm about its allocations (squeue), and the longest one
    # Slurm command may take.
    slurm_poll_seconds: float = Field(2.0, gt=0)
    slurm_command_timeout_seconds: float = Field(30.0, gt=0)
    # A started allocation whose agents have not all registered after this long has lost the
    # missing nodes: it is replaced by one without them.
    slurm_agent_start_seconds: float = Field(300.0, gt=0)
    # A failure's diagnosis is read from its rank's last lines (service/failures/diagnosis.py): these
    # [diagnosis, regular expression] pairs are tried first, before the built-in table.
    failure_patterns: list[tuple[str, str]] = []
    # A node with this much node evidence within the window is drained until an admin returns it
    # (`ett nodes return`): its agent's health check starting to fail, a kernel record its agent read
    # (a hardware Xid, an uncorrected ECC error, an out-of-memory kill over no limit of a job's own),
    # its heartbeats gone. A job's failures never count, whatever it printed (service/agents/node_evidence.py).
    node_failure_limit: int = Field(3, ge=1)
    node_failure_window_seconds: float = Field(3600.0, gt=0)

    @field_validator("database_url")
    @classmethod
    def _known_backend(cls, url: str) -> str:
        if url and not url.startswith(("sqlite", "postgresql")):
            raise ValueError("ETT_DATABASE_URL must be a sqlite:// or postgresql+psycopg:// URL")
        return url

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir.resolve() / 'ett.db'}"

    @field_validator("slurm_agent_env")
    @classmethod
    def _agent_settings_only(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not name.startswith("ETT_AGENT_") or not name.replace("_", "").isalnum():
                raise ValueError(f"ETT_SLURM_AGENT_ENV: {name!r} is not an agent setting (ETT_AGENT_...)")
            if name in SLURM_AGENT_ENV_REFUSED:
                raise ValueError(f"ETT_SLURM_AGENT_ENV: {name}: {SLURM_AGENT_ENV_REFUSED[name]}")
        return env

    @field_validator("failure_patterns")
    @classmethod
    def _valid_patterns(cls, patterns: list[tuple[str, str]]) -> list[tuple[str, str]]:
        for index, (diagnosis, pattern) in enumerate(patterns):
            if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", diagnosis):
                raise ValueError(f"ETT_FAILURE_PATTERNS[{index}]: diagnosis {diagnosis!r} must be 1-32 of [a-z0-9_]")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"ETT_FAILURE_PATTERNS[{index}]: {pattern!r} is no regular expression: "
                                 f"{exc}") from None
        return patterns

    @property
    def resolved_slurm_dir(self) -> Path:
        return (self.slurm_dir or self.data_dir / "slurm").resolve()

    @property
    def resolved_checkpoint_root(self) -> Path:
        return (self.checkpoint_root or self.data_dir / "checkpoints").resolve()


@lru_cache
def get_settings() -> Settings:
    return Settings()
