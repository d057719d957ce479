"""The rendezvous of an attempt: a master port on its first node that no active attempt there uses."""

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import ACTIVE_ATTEMPT_STATES, Attempt, Job
from service.settings import Settings


def free_master_port(session: Session, settings: Settings, address: str, job: Job) -> int:
    used = set(session.scalars(
        select(Attempt.master_port).where(Attempt.master_addr == address, Attempt.state.in_(ACTIVE_ATTEMPT_STATES))
    ))  # fmt: skip
    # Step away from the previous attempt's port: its rendezvous store may not be closed yet.
    start = (sum(job.id.encode()) + 7 * len(job.attempts)) % settings.master_port_count
    for i in range(settings.master_port_count):
        port = settings.master_port_first + (start + i) % settings.master_port_count
        if port not in used:
            return port
    raise RuntimeError(f"no free rendezvous port on {address}")
