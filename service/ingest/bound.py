"""A job's bound on the events it stores: ETT_MAX_EVENTS_PER_RANK for each rank of its world (nodes x
procs_per_node: a big job's ranks each send their step timings), all its attempts together. A job's
library or script may emit events without end (custom kinds, a step loop gone wild): past the
bound, ingestion stores none of its new events and answers them `refused` (200: the agent does not
send them again), and the job is stopped with the bound for reason (service/jobs/event_limit.py).

Counted on the job's accounting row (`ett_accounts.events`), read under the lock ingestion holds on
it and written in the same transaction: no count over the events table. The service's own events
(an attempt's failure, the job's end) are never refused, so the job's record stays whole.
"""

from sqlalchemy.orm import Session

from service.ingest.rows import Pending, stored_events
from service.settings import Settings

Key = tuple[int, str, int]  # (attempt, source, seq)


def event_bound(world: int, settings: Settings) -> int:
    return settings.max_events_per_rank * world


def bound_reason(world: int, settings: Settings) -> str:
    """Why a job over its bound is stopped (the attempt's detail, the job's reason): the bound and its setting."""
    return (f"the job sent more events than its bound of {event_bound(world, settings):,} "
            f"(ETT_MAX_EVENTS_PER_RANK {settings.max_events_per_rank:,} x {world} ranks); "
            "those past it were not stored")  # fmt: skip


def take_past_bound(session: Session, by_job: dict[str, dict[Key, Pending]], counts: dict[str, int],
                    worlds: dict[str, int], settings: Settings) -> dict[str, set[Key]]:
    """Takes out of `by_job` each job's new events past its bound (`counts`: the events it has
    stored), the latest to come, and returns their keys by job. Which events are repeats (stored before: no new rows, kept to be checked as
    repeats) is looked up only for a job whose events would cross its bound."""
    past: dict[str, set[Key]] = {}
    for job_id, events in by_job.items():
        room = event_bound(worlds[job_id], settings) - counts[job_id]
        if len(events) <= room:
            continue
        repeats = stored_events(session, job_id, list(events))
        new = [key for key in events if key not in repeats]
        for key in new[max(room, 0) :]:
            past.setdefault(job_id, set()).add(key)
            del events[key]
    return past

