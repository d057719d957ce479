"""The service's side of Slurm, one pass every ETT_SLURM_POLL_SECONDS (docs/slurm.md).

Each pass reads what Slurm says of the live allocations (one squeue), then for each:
- started: its nodes are recorded (and named in the next attempt's `attempt_allocated` event);
- ended in Slurm (time limit, preemption, node failure, cancelled outside ETT): its token is
  revoked, its agents' nodes are out, an attempt still running on it fails with Slurm's cause,
  and the job gets a new allocation if it may go on;
- its ETT job finished or was cancelled: released (scancel);
- a node lost (its agent silent past the heartbeat timeout, or never registered): released, and
  the job's next allocation leaves that node out.
Then every Slurm job that still needs an allocation gets one (sbatch). Restarts of a failed
attempt need no new allocation: the scheduler starts them on the same agents.

Slurm's commands run outside the database's transactions, except sbatch and scancel, which run
inside the transaction that records what they did (a service that dies between the two then
leaves nothing unrecorded behind).
"""

import logging
import os
import time
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.scheduler import ACTIVE, fail_attempt, finish_job
from service.models import Job, JobState, Node, NodeState, Role, SlurmAllocation, SlurmState, Token, utc_at
from service.security import create_token, find_token
from service.settings import Settings
from service.slurm.batch import SCRIPT_FILE, TOKEN_FILE, render_script, sbatch_options
from service.slurm.commands import Slurm, SlurmError, SlurmJob, SlurmUnreachable

log = logging.getLogger(__name__)

# Slurm's end states that are no fault of the job's: the attempt fails with this cause and the
# job goes on in a new allocation. Any other end ("terminated") does too, but an allocation that
# ends so before any of its agents registered fails the job (its batch script cannot start them).
CAUSES = {"TIMEOUT": "time_limit", "PREEMPTED": "preempted", "NODE_FAIL": "node_lost", "BOOT_FAIL": "node_lost"}



class SlurmBridge:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, slurm: Slurm | None = None) -> None:
        self.sessions, self.settings = sessions, settings
        self.slurm = slurm or Slurm(settings.slurm_command_timeout_seconds)
        if os.geteuid() != 0 and not settings.slurm_agent_command:
            # sbatch starts the allocation as this service's user: its agents, not root, would
            # refuse to run the jobs (agent/slurm.py), and every job would fail at its start.
            log.error("ETT_SLURM: this service runs as uid %d, so its allocations' agents would too; they must "
                      "be root to run each owner's jobs as a uid of its own: run the service as root, or "
                      "set ETT_SLURM_AGENT_COMMAND to start the agent as root (docs/slurm.md)", os.geteuid())

    def sync(self, now: float | None = None) -> None:
        """One pass: follow the live allocations, then submit the ones jobs need."""
        now = time.time() if now is None else now
        with self.sessions() as session:
            live = {a.slurm_job_id: a.state for a in session.scalars(
                select(SlurmAllocation).where(SlurmAllocation.state != SlurmState.ended))}  # fmt: skip
        told = self.slurm.jobs(list(live))
        # Node names of the allocations that started since the last pass (scontrol, outside the transaction).
        started = {job_id: self.slurm.hostnames(job.nodelist) for job_id, job in told.items()
                   if live[job_id] == SlurmState.submitted and job.state == "RUNNING"}  # fmt: skip
        with self.sessions() as session:
            allocations = session.scalars(
                select(SlurmAllocation).where(SlurmAllocation.slurm_job_id.in_(live),
                                              SlurmAllocation.state != SlurmState.ended)
                .with_for_update(skip_locked=True)
            ).all()  # fmt: skip
            for allocation in allocations:
                self._follow(session, allocation, told.get(allocation.slurm_job_id), started, now)
            self._revoke_spent_tokens(session, now)
            session.commit()
        self._submit_needed(now)

    # -- following one allocation ------------------------------------------------------------

    def _follow(
        self, session: Session, allocation: SlurmAllocation, job_now: SlurmJob | None, started: dict[str, list[str]],
        now: float,
    ) -> None:
        job = allocation.job
        if job_now is None or not job_now.live:
            self._ended(session, allocation, job_now, now)
            return
        allocation.slurm_state, allocation.slurm_reason = job_now.state, job_now.reason
        if allocation.slurm_job_id in started:
            allocation.state, allocation.started_at = SlurmState.running, utc_at(now)
            allocation.slurm_nodes = started[allocation.slurm_job_id]
            log.info("job %s: Slurm job %s runs on %s", job.id, allocation.slurm_job_id,
                     ",".join(allocation.slurm_nodes))
        if job.state not in (JobState.queued, JobState.running):
            self._release(session, allocation, f"ETT job {job.state.value}", now)
        elif allocation.state == SlurmState.submitted:
            why = f" ({job_now.reason})" if job_now.reason else ""
            waiting = f"waiting in Slurm's queue: job {allocation.slurm_job_id} is {job_now.state}{why}"
            if job.state == JobState.queued and job.reason != waiting:
                job.reason = waiting
        else:
            bad = self._bad_nodes(session, allocation, now)
            if bad:
                allocation.bad_nodes = bad
                detail = (f"Slurm node {', '.join(bad)} of job {allocation.slurm_job_id} lost: "
                          "a new allocation without it")
                for attempt in job.attempts:
                    if attempt.state in ACTIVE:
                        fail_attempt(session, attempt, "node_lost", detail, now)
                self._release(session, allocation, detail, now)

    def _bad_nodes(self, session: Session, allocation: SlurmAllocation, now: float) -> list[str]:
        """Its Slurm nodes whose agent was declared lost, or never registered in time."""
        agents = {node.name.removeprefix(_agent_prefix(allocation)): node for node in _agents_of(session, allocation)}
        bad = {name for name, node in agents.items() if node.state == NodeState.lost}
        started = allocation.started_at.timestamp() if allocation.started_at else now
        if now - started > self.settings.slurm_agent_start_seconds:
            bad |= set(allocation.slurm_nodes) - set(agents)
        return sorted(bad)

    def _ended(self, session: Session, allocation: SlurmAllocation, job_now: SlurmJob | None, now: float) -> None:
        """Slurm ended it (or forgot it): it and its agents are done; its job goes on elsewhere if it may."""
        state = job_now.state if job_now else "ENDED"
        allocation.slurm_state, allocation.slurm_reason = state, job_now.reason if job_now else None
        agents = _agents_of(session, allocation)
        registered = bool(agents)
        # Agents that Slurm told to stop say they are leaving (SIGTERM); one that is not vanished
        # (its node crashed, or it was killed): that node is left out of the job's next allocation.
        vanished = sorted(n.name.removeprefix(_agent_prefix(allocation)) for n in agents
                          if n.state in (NodeState.idle, NodeState.busy, NodeState.lost))  # fmt: skip
        if state not in ("TIMEOUT", "PREEMPTED", "CANCELLED", "COMPLETED"):
            allocation.bad_nodes = vanished
        self._retire(session, allocation, agents, now)
        job = allocation.job
        if job.state not in (JobState.queued, JobState.running):
            return
        why = f" ({allocation.slurm_reason})" if allocation.slurm_reason else ""
        detail = f"Slurm job {allocation.slurm_job_id} ended: {state}{why}"
        cause = CAUSES.get(state, "terminated")
        if allocation.bad_nodes:
            cause, detail = "node_lost", f"the agent on {', '.join(allocation.bad_nodes)} vanished; {detail}"
        for attempt in job.attempts:
            if attempt.state in ACTIVE:
                fail_attempt(session, attempt, cause, detail, now)
        if job.state not in (JobState.queued, JobState.running):
            return  # no restart left
        if state == "CANCELLED":
            reason = f"{detail}: cancelled outside ETT (scancel); `ett cancel` ends an ETT job"
            finish_job(session, job, JobState.failed, reason, now)
        elif not registered and state not in CAUSES:
            output = self._folder(job, allocation.number) / f"slurm-{allocation.slurm_job_id}.out"
            reason = f"{detail} before any of its agents registered; see {output}"
            finish_job(session, job, JobState.failed, reason, now)
        log.warning("job %s: %s", job.id, detail)

    def _release(self, session: Session, allocation: SlurmAllocation, why: str, now: float) -> None:
        """Cancels it in Slurm (inside the transaction: a refusal leaves it live, tried next pass)."""
        self.slurm.cancel([allocation.slurm_job_id])
        allocation.slurm_reason = why[:256]
        self._retire(session, allocation, _agents_of(session, allocation), now)
        log.info("job %s: Slurm job %s released: %s", allocation.job_id, allocation.slurm_job_id, why)

    @staticmethod
    def _retire(session: Session, allocation: SlurmAllocation, agents: list[Node], now: float) -> None:
        allocation.state, allocation.ended_at = SlurmState.ended, utc_at(now)
        for node in agents:
            node.state = NodeState.lost  # its agents say they are leaving, or are gone: not revived

    def _revoke_spent_tokens(self, session: Session, now: float) -> None:
        """The tokens of allocations ended more than the stop grace ago: their agents had that long
        to forward the last events (a final checkpoint's) and are gone; nothing may use them since."""
        spent = select(SlurmAllocation.token_id).where(
            SlurmAllocation.state == SlurmState.ended,
            SlurmAllocation.ended_at < utc_at(now - self.settings.stop_grace_seconds))
        for token in session.scalars(select(Token).where(Token.id.in_(spent), ~Token.revoked)):
            token.revoked = True

    # -- new allocations ---------------------------------------------------------------------

    def _submit_needed(self, now: float) -> None:
        with self.sessions() as session:
            waiting = session.scalars(
                select(Job.id).where(Job.state.in_((JobState.queued, JobState.running)))
                .where(~select(SlurmAllocation.id).where(SlurmAllocation.job_id == Job.id,
                                                         SlurmAllocation.state != SlurmState.ended).exists())
            ).all()  # fmt: skip
        for job_id in waiting:
            with self.sessions() as session:
                job = session.scalar(select(Job).where(Job.id == job_id).with_for_update(skip_locked=True))
                if job is None or job.spec.slurm is None or not self._needs_allocation(job, now):
                    continue
                try:
                    self._submit(session, job, now)
                except SlurmUnreachable as exc:
                    log.warning("job %s: sbatch failed, tried again next pass: %s", job.id, exc)
                    continue
                except SlurmError as exc:  # Slurm refused the job's own settings: a bad partition, account, option
                    finish_job(session, job, JobState.failed, f"sbatch refused the job: {exc}", now)
                session.commit()

    def _needs_allocation(self, job: Job, now: float) -> bool:
        if job.state not in (JobState.queued, JobState.running):
            return False
        if any(a.state != SlurmState.ended for a in job.slurm_allocations):
            return False  # another service process got there first
        last = job.slurm_allocations[-1] if job.slurm_allocations else None
        backoff = self.settings.restart_backoff_seconds
        return last is None or last.ended_at is None or now >= last.ended_at.timestamp() + backoff

    def _folder(self, job: Job, number: int) -> Path:
        return self.settings.resolved_slurm_dir / job.id / str(number)

    def _submit(self, session: Session, job: Job, now: float) -> None:
        number = len(job.slurm_allocations)
        folder = self._folder(job, number)
        for made in (folder.parent.parent, folder.parent, folder):  # 0700 each: no one else lists the jobs either
            made.mkdir(mode=0o700, parents=True, exist_ok=True)
        secret = create_token(session, Role.agent, f"slurm:{job.id}:{number}", job_id=job.id)
        token = find_token(session, secret)
        token_file = folder / TOKEN_FILE
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the service's user alone reads it
        with os.fdopen(fd, "w") as out:
            out.write(secret + "\n")
        script = folder / SCRIPT_FILE
        script.write_text(render_script(self.settings, folder, job.spec.procs_per_node))
        bad = sorted({name for earlier in job.slurm_allocations for name in earlier.bad_nodes})
        try:
            slurm_job_id = self.slurm.submit(str(script), sbatch_options(job.spec, job.id, folder, bad))
        except SlurmError as refused:
            if not bad or isinstance(refused, SlurmUnreachable):
                raise
            # Leaving the bad nodes out leaves too few to run on: take any, the bad ones included.
            log.warning("job %s: sbatch --exclude=%s refused (%s): submitted without it", job.id, ",".join(bad),
                        refused)
            slurm_job_id = self.slurm.submit(str(script), sbatch_options(job.spec, job.id, folder, []))
        session.add(SlurmAllocation(job=job, number=number, slurm_job_id=slurm_job_id, token_id=token.id,
                                    submitted_at=utc_at(now)))  # fmt: skip
        if job.state == JobState.queued:
            job.reason = f"submitted to Slurm as job {slurm_job_id}"
        log.info("job %s: submitted to Slurm as job %s (allocation %d)", job.id, slurm_job_id, number)


def _agent_prefix(allocation: SlurmAllocation) -> str:
    return f"slurm-{allocation.slurm_job_id}-"  # the batch script names its agents so (service/slurm/batch.py)


def _agents_of(session: Session, allocation: SlurmAllocation) -> list[Node]:
    """The nodes its agents registered (named after the Slurm job, bound to the ETT job)."""
    return list(session.scalars(select(Node).where(
        Node.job_id == allocation.job_id, Node.name.startswith(_agent_prefix(allocation), autoescape=True))))
