"""Slurm's own commands (sbatch, scancel, squeue, scontrol), each run with a timeout; a refusal
becomes a SlurmError carrying Slurm's one-line message."""

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

# Slurm job states in which the allocation holds (or will hold) its nodes; any other has ended.
# COMPLETING too: its processes are being signalled (a time limit, a preemption), and its agents
# report the cause they saw before squeue shows the end state.
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
                         "COMPLETING", "STAGE_OUT"})  # fmt: skip


class SlurmError(RuntimeError):
    """A Slurm command that failed; the message is Slurm's own last line."""


class SlurmUnreachable(SlurmError):
    """Slurm did not answer (slurmctld down or too slow): worth trying again later."""


UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Connection refused",
               "Zero Bytes were transmitted")


@dataclass(frozen=True)
class SlurmJob:
    state: str  # PENDING, RUNNING, COMPLETING, TIMEOUT, PREEMPTED, NODE_FAIL, CANCELLED, ...
    reason: str | None  # why it waits or ended, as Slurm says it (Priority, Resources, TimeLimit)
    nodelist: str  # compressed: n[1-2]; empty before it starts

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


class Slurm:
    """The Slurm commands on this machine's PATH (or in `bin_dir`), talking to the cluster its
    slurm.conf names (or $SLURM_CONF)."""

    def __init__(self, timeout: float = 30.0, bin_dir: str = "") -> None:
        self.timeout, self.bin_dir = timeout, bin_dir.rstrip("/")

    def _run(self, argv: Sequence[str]) -> str:
        program = f"{self.bin_dir}/{argv[0]}" if self.bin_dir else argv[0]
        try:
            done = subprocess.run([program, *argv[1:]], capture_output=True, text=True, timeout=self.timeout)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]}: not found: install Slurm's client commands (Debian: slurm-client)") from None
        except subprocess.TimeoutExpired:
            raise SlurmUnreachable(f"{argv[0]}: no answer in {self.timeout:g} s (is slurmctld up?)") from None
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            message = lines[-1] if lines else f"{argv[0]} exited with code {done.returncode}"
            raise (SlurmUnreachable if any(s in message for s in UNREACHABLE) else SlurmError)(message)
        return done.stdout

    def submit(self, script: str, options: Sequence[str]) -> str:
        """Submits a batch script with these sbatch options; the Slurm job id."""
        out = self._run(["sbatch", "--parsable", *options, script]).strip()
        return out.split(";", 1)[0]  # "<id>;<cluster>" on a federation

    def cancel(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            self._run(["scancel", *job_ids])

    def jobs(self, job_ids: Sequence[str]) -> dict[str, SlurmJob]:
        """What Slurm knows of these jobs: the live ones, and the ended ones it still remembers
        (MinJobAge); a job missing from the answer ended long enough ago to be forgotten."""
        if not job_ids:
            return {}
        # Our own jobs in every state: `--jobs` with one id Slurm already forgot fails the whole call.
        out = self._run(["squeue", "--me", "--noheader", "--states=all", "--format=%i|%T|%r|%N"])
        wanted, found = set(job_ids), {}
        for line in out.splitlines():
            job_id, state, reason, nodelist = (line.split("|", 3) + ["", "", ""])[:4]
            if job_id in wanted:
                found[job_id] = SlurmJob(state, None if reason in ("", "None") else reason, nodelist.strip())
        return found

    def hostnames(self, nodelist: str) -> list[str]:
        """n[1-2] -> [n1, n2]."""
        return self._run(["scontrol", "show", "hostnames", nodelist]).split() if nodelist else []
