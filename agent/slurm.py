"""An agent inside a Slurm allocation (docs/slurm.md): why Slurm is stopping it.

Slurm ends a job step with SIGTERM, then SIGKILL after the cluster's KillWait: at its time
limit, when a higher-priority job preempts it, or when it is cancelled. By the time the signal
arrives slurmctld has already set the job's state (TIMEOUT, PREEMPTED, CANCELLED), so asking
scontrol tells which it was.
"""

import os
import subprocess

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
