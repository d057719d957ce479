"""The agent's one validated configuration, read from ETT_AGENT_* environment variables.

The prefix is ETT_AGENT_ rather than ETT_ so an agent and a service can share a machine (and a
shell) without one reading the other's ETT_DATA_DIR. One exception: without a service URL, the agent
calls the service as the `ett` commands do (ETT_SERVICE_URL, else this machine's at ETT_PORT).
"""

import os
import socket
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ett.protocol import service_url
from ett.protocol.messages import NAME_PATTERN


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ETT_AGENT_", extra="forbid")

    # Unset: the `ett` commands' rule (ett.protocol.service_url): ETT_SERVICE_URL, else this machine's at ETT_PORT.
    service_url: str = ""
    # The agent token: from ETT_AGENT_TOKEN, or read from the file ETT_AGENT_TOKEN_FILE names (never a
    # command-line flag: `ps` would show it to every user of the node).
    token: str = Field("", repr=False)
    token_file: Path | None = None
    name: str = Field(default_factory=socket.gethostname)
    # Address the other nodes of a job reach this one on (used as torchrun's master address).
    address: str = "127.0.0.1"
    slots: int = Field(1, ge=1)
    data_dir: Path = Path("agent-data")
    # Node-local fast disk where the ranks save checkpoints first (default DATA_DIR/checkpoints).
    local_checkpoint_dir: Path | None = None
    # Where jobs' checkpoint folders may be (the service's checkpoint root, as this node mounts it):
    # a launch whose folder resolves elsewhere is refused. None: only the job's own area is checked.
    checkpoint_root: Path | None = None
    # Who runs the jobs' processes (agent/confinement/job_user.py, docs/agent.md "The job's user"): an agent
    # started as root runs each owner's jobs as a uid of its own, job_uid_base plus the owner's
    # number (the service's), below job_uid_base + job_uid_count; with job_user, every job as that
    # user (as root only with allow_root_jobs). Any other agent runs them as itself.
    job_user: str | None = None
    allow_root_jobs: bool = False
    job_uid_base: int = Field(2_000_000_000, ge=1000, le=4_000_000_000)
    job_uid_count: int = Field(1_000_000, ge=1)
    # The interpreter of the jobs' processes (torchrun, rank runners, the trainer): one the job's
    # user can run, with ett installed. Default: the agent's own.
    job_python: str = Field(default_factory=lambda: sys.executable, min_length=1)
    # Keep a process with the trainer imported, and fork trainer ranks from it (agent.warm.server).
    warm_start: bool = True
    # What it warms as it starts, for its fixed job user (agent.daemon): the built-in trainer's server
    # (`trainer`), the base server every `python SCRIPT` job forks from and its learned servers are
    # forked from (`scripts`: torch, the library), `both` or `none` (each starts at a job's first launch,
    # which waits for it). An agent of per-owner uids warms nothing before a job comes.
    warm_at_start: Literal["trainer", "scripts", "both", "none"] = "trainer"
    # Let a job's `lose_node` fault take this node down as a dead machine would: every job's
    # processes, the job's node-local checkpoints, the agent itself. For drills and demos on nodes
    # no other team shares; off, a launch with that fault is refused.
    node_loss_drills: bool = False

    heartbeat_interval_seconds: float = Field(3.0, gt=0)
    # A heartbeat long-polls this long for commands; at most the service's own limit is used.
    heartbeat_wait_seconds: float = Field(3.0, ge=0)
    request_timeout_seconds: float = Field(10.0, gt=0)
    # SIGTERM first, SIGKILL after this many seconds (stop, hang, end of a failed group).
    stop_grace_seconds: float = Field(10.0, ge=0)
    monitor_interval_seconds: float = Field(0.1, gt=0)

    batch_max_events: int = Field(500, ge=1)
    batch_max_age_seconds: float = Field(0.5, ge=0)
    # Before reporting an attempt's end, wait at most this long for what its ranks wrote to be forwarded.
    flush_before_report_seconds: float = Field(1.0, ge=0)
    retry_base_seconds: float = Field(0.5, gt=0)
    retry_max_seconds: float = Field(30.0, gt=0)
    # Forwarded spool data is given back to the disk; past this much unforwarded, the agent warns.
    spool_max_bytes: int = Field(1 << 30, ge=1)
    # The operator's node health check, a command line (e.g. "nvidia-smi"): run at start, before
    # each launch and every interval; failing, the node takes no new work (agent/node/health.py).
    health_check: str | None = None
    health_check_interval_seconds: float = Field(300.0, gt=0)
    # Each rank's output is kept in a file rotated at this size (at most twice it per rank on the
    # node) and shipped to the service, which keeps its last part (agent/launching/rank_log.py).
    rank_log_max_bytes: int = Field(16 << 20, ge=4096)
    # The agent's own /metrics; 0 turns the endpoint off.
    metrics_port: int = Field(0, ge=0, le=65535)
    # Tests only: pretend this node's clock is this far off. Every time the service gets from
    # the node (the heartbeat's clock, each event's ts) is shifted by it, as a skewed clock would.
    clock_offset_seconds: float = 0.0

    @model_validator(mode="after")
    def _service_as_the_commands_find_it(self) -> "AgentSettings":
        if not self.service_url:  # neither --service nor ETT_AGENT_SERVICE_URL
            self.service_url = service_url(os.environ)  # ValueError: names ETT_SERVICE_URL or ETT_PORT
        return self

    @model_validator(mode="after")
    def _token_from_file(self) -> "AgentSettings":
        if self.token_file is not None:
            if self.token:
                raise ValueError("set one of ETT_AGENT_TOKEN and ETT_AGENT_TOKEN_FILE, not both")
            try:
                self.token = self.token_file.read_text().strip()
            except OSError as exc:
                raise ValueError(f"ETT_AGENT_TOKEN_FILE {self.token_file}: {exc.strerror}") from None
        if not self.token:
            raise ValueError("no agent token: set ETT_AGENT_TOKEN_FILE (a file holding it) or ETT_AGENT_TOKEN")
        return self

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if not NAME_PATTERN.match(name):
            raise ValueError("ETT_AGENT_NAME must be 1-128 characters of [A-Za-z0-9._-]")
        return name

    @field_validator("service_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if url and not url.startswith(("http://", "https://")):
            raise ValueError("ETT_AGENT_SERVICE_URL must start with http:// or https://")
        return url.rstrip("/")

    @property
    def spool_root(self) -> Path:
        return self.data_dir / "spool"

    @property
    def local_checkpoint_root(self) -> Path:
        return (self.local_checkpoint_dir or self.data_dir / "checkpoints").resolve()
