"""An agent inside a Slurm allocation (docs/slurm.md): why Slurm is stopping it.

Slurm ends a job step with SIGTERM, then SIGKILL after the cluster's KillWait: at its time
limit, when a higher-priority job preempts it, or when it is cancelled. By the time the signal
arrives slurmctld has already set the job's state (TIMEOUT, PREEMPTED, CANCELLED), so asking
scontrol tells which it was.

An allocation's agent serves one owner's job on nodes other owners' allocations share, and reads
a token the service left on shared storage: it runs as root, each owner's jobs as a uid of that
owner's (as on every node), so no job reads the token (`allocation_problem`, docs/slurm.md).
"""

import os
import pwd
import stat
import subprocess
from pathlib import Path

from agent.confinement.job_user import JobUsers
from agent.groups.states import GroupEnd, WorkerState

CAUSES = {"TIMEOUT": "time_limit", "PREEMPTED": "preempted"}


def slurm_job_id() -> str | None:
    """The Slurm job this agent runs in, if any."""
    return os.environ.get("SLURM_JOB_ID") or None


def job_fields(job_id: str, timeout: float = 5.0) -> dict[str, str]:
    """`scontrol show job -o ID` as a dict (empty when scontrol cannot answer)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             timeout=timeout).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def termination(job_id: str) -> GroupEnd:
    """How the attempt's share on this node ends when Slurm sends SIGTERM: failed, with Slurm's cause."""
    fields = job_fields(job_id)
    state = fields.get("JobState", "unknown")
    reason = fields.get("Reason", "None")
    detail = f"SIGTERM from Slurm: job {job_id} is {state}" + (f" ({reason})" if reason != "None" else "")
    return GroupEnd(WorkerState.FAILED, CAUSES.get(state, "terminated"), detail)


def allocation_problem(token_file: Path | None, users: JobUsers) -> str | None:
    """Why this agent may not serve a Slurm allocation (None: it may): its jobs would not run as
    their owners' uids, or a job's uid could read its token."""
    if users.fixed is not None:
        me = pwd.getpwuid(os.geteuid()).pw_name
        return (f"in a Slurm allocation this agent runs as {me} and would run every owner's jobs as "
                f"{users.fixed.name}: an allocation's agents run as root, and each owner's jobs as a uid of its "
                "own; submit as root (the service as root), leave ETT_AGENT_JOB_USER unset (docs/slurm.md)")
    if token_file is None:
        return None
    try:
        found = os.stat(token_file)
    except OSError as exc:
        return f"ETT_AGENT_TOKEN_FILE {token_file}: {exc.strerror}"
    mode = stat.S_IMODE(found.st_mode)
    if mode & 0o077:
        return f"ETT_AGENT_TOKEN_FILE {token_file} is mode {mode:o}: other users could read the token; 600 only"
    if users.uid_base <= found.st_uid < users.uid_base + users.uid_count:
        return f"ETT_AGENT_TOKEN_FILE {token_file} belongs to uid {found.st_uid}, a job's: that job could read it"
    return None
