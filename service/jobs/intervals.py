"""`interval_steps: "auto"` kept up to date while an attempt runs: the ranks learn a new interval
without a restart (docs/jobspec.md, `checkpoint.interval_steps`).

Each scheduler pass looks at the running attempts of `auto` jobs. When Young's interval from the
job's measured costs (service/jobs/checkpoints.py) differs from the one its ranks have by more
than CHANGE_RATIO, every node of the attempt is told `{"type": "checkpoint_interval",
"interval_steps": N, "from_step": S}`: its agent writes it where the ranks read it
(`ETT_CHECKPOINT_INTERVAL_FILE`), and every rank applies it from step S on. A save is a
collective, so all ranks must switch at the same step: S lies MARGIN_SECONDS of the job's steps
(at least MARGIN_STEPS) ahead of the newest step, time for the command to reach every node.
"""

import math
import time

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from ett.protocol.event_fields import CheckpointIntervalData
from ett.protocol.messages import IntervalCommand
from service.accounting.accounts import job_account
from service.agents import commands
from service.jobs.checkpoints import checkpoint_interval_steps
from service.jobs.service_events import emit
from service.models import Attempt, AttemptState, Job, JobState
from service.settings import Settings

CHANGE_RATIO = 0.2
MARGIN_STEPS = 5
MARGIN_SECONDS = 3.0


def retune_auto_intervals(session: Session, settings: Settings, now: float | None = None) -> None:
    now = time.time() if now is None else now
    running = session.scalars(
        select(Attempt).join(Job).where(Attempt.state == AttemptState.running, Job.state == JobState.running)
        .options(selectinload(Attempt.nodes), selectinload(Attempt.job))
    ).all()  # fmt: skip
    for attempt in running:
        job = attempt.job
        if job.spec.checkpoint.interval_steps != "auto" or attempt.interval_steps is None:
            continue
        interval = checkpoint_interval_steps(session, job, settings)
        if abs(interval - attempt.interval_steps) <= CHANGE_RATIO * attempt.interval_steps:
            continue
        summary = job_account(session, job.id).attempts.get(attempt.number)
        if summary is None or not summary.steps or summary.last_step is None:
            continue  # no step of this attempt seen yet: nothing to time the switch by
        step_time = summary.step_seconds / summary.steps
        from_step = summary.last_step + max(MARGIN_STEPS, math.ceil(MARGIN_SECONDS / max(step_time, 1e-6)))
        command = IntervalCommand(type="checkpoint_interval", job_id=job.id, attempt=attempt.number,
                                  interval_steps=interval, from_step=from_step)
        for share in attempt.nodes:
            commands.enqueue(session, share.node, command)
        emit(session, job.id, attempt.number, "checkpoint_interval", now,
             CheckpointIntervalData(interval_steps=interval, from_step=from_step, was=attempt.interval_steps))
        attempt.interval_steps = interval
