"""What the job page says beside the report's figures: what each figure and category means, the
checkpoint intervals in the job's own unit (steps, with their time beside), and the job's reason
with its failure's text left to the failures table, so that each failure's text stands once."""

from dataclasses import dataclass
from typing import Any

from service.accounting.engine import JobAccount
from service.jobs.checkpoints import mean_step_seconds, steps_in
from service.models import Job

# Short, for the page: the full rules are docs/ett.md's.
MEANINGS = {
    "ett": "the share of the wall time spent in training steps whose results were kept",
    "full_speed": "ETT less the slow share: the kept steps counted at the ideal step time (the 10th percentile "
                  "of an attempt's step times; docs/ett.md, Slow time)",
    "slow": "the kept steps' time above the ideal step time: a slow rank, data loader or link",
    "capacity": "ETT less the reduced share: the kept steps' node-seconds over the wall time at the job's full size",
    "reduced_capacity": "kept steps on fewer nodes than the job's full size, counted at the share missing: "
                        "(N - n) / N of each second on n of N nodes",
    "wall": "from the first allocation to the end of the job (or now)",
    "queued": "from submission to the first allocation",
    "time_to_start": "from the first allocation to the first step's start",
    "restarts": "attempts after the first",
    "mtbf": "mean time between failures: the wall time over the failures",
    "productive": "in training steps whose results were kept",
    "wasted": "in steps rolled back: done again after a restart from an older checkpoint",
    "checkpoint_save": "the part of each save that stops training (its start to staged); the write after it "
                       "overlaps training",
    "restore": "loading a checkpoint at an attempt's start",
    "init": "from an allocation to its first step, less the restore: start-up, imports, building the model",
    "recovery": "from a failed attempt's last completed work to the next attempt's allocation",
    "idle": "the rest: between steps (a data wait outside the step, evaluation), after the last step",
    "time_to_recover": "from the failed attempt's last step to the next step of a later attempt",
    "lost_steps": "the steps rolled back: where the model was, less where the next attempt restarted",
    "committed": "saves whose every rank wrote its part",
    "last_step": "the step of the newest committed checkpoint",
    "mean_blocking": "the mean time a save stopped training (start to staged)",
    "mean_commit": "the mean time from a save's start to its commit",
    "interval": "the job's checkpoint.interval_steps (auto: kept near the recommended one as the job runs), "
                "and its time at the job's mean step",
    "recommended_interval": "Young's interval, sqrt(2 x mean blocking x MTBF), in steps at the job's mean step",
}  # fmt: skip


@dataclass(frozen=True)
class Intervals:
    steps: int | None  # the job's: its latest attempt's ("auto" moves it), else its spec's number
    auto: bool
    seconds: float | None  # `steps` at the job's mean step time
    recommended_steps: int | None
    recommended_seconds: float | None


def checkpoint_intervals(job: Job, account: JobAccount, report: dict[str, Any]) -> Intervals:
    step = mean_step_seconds(account)
    spec = job.spec.checkpoint.interval_steps
    steps = next((a.interval_steps for a in reversed(job.attempts) if a.interval_steps is not None), None)
    if steps is None and spec != "auto":
        steps = int(spec)
    recommended = report["recommended_checkpoint_interval_seconds"]
    return Intervals(
        steps=steps, auto=spec == "auto",
        seconds=steps * step if steps is not None and step is not None else None,
        recommended_steps=steps_in(recommended, step) if recommended is not None and step is not None else None,
        recommended_seconds=recommended,
    )  # fmt: skip


@dataclass(frozen=True)
class Reason:
    """The job's reason around the failure text it repeats: `before`, a reference to the failure of
    attempt `attempt` in the failures table (None: the reason repeats none), `after`."""

    before: str
    attempt: int | None = None
    after: str = ""


def reason_of(reason: str | None, failures: list[dict[str, Any]]) -> Reason | None:
    """The reason of a job that stopped for a failure ("failed after 2 restarts: rank 1 exit code 1")
    repeats that failure's detail or diagnosis, which the failures table shows: the newest failure
    whose text it holds is referred to instead."""
    if not reason:
        return None
    for failure in reversed(failures):
        diagnosed = f"{failure['diagnosis']}: {failure['summary']}" if failure["summary"] else None
        for text in (failure["detail"], diagnosed, failure["summary"]):
            if text and text in reason:
                before, _, after = reason.partition(text)
                return Reason(before, failure["attempt"], after)
    return Reason(reason)
