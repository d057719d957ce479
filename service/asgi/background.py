"""The service process's background tasks on its event loop: the scheduler's clock, the Slurm
bridge's (with ETT_SLURM), the jobs' notifications' and the garbage collector's."""

import asyncio
import contextlib
import gc
import logging
import time

import httpx
from fastapi.concurrency import run_in_threadpool

from service.context import ServiceContext
from service.jobs import scheduler
from service.webhooks import notifications
from service.slurm.allocations import SlurmBridge
from service.stragglers.watch import Watch

log = logging.getLogger("ett.service")


async def run_scheduler(context: ServiceContext, wake: asyncio.Event, stop: asyncio.Event) -> None:
    """Ticks the scheduler when woken (a submit, an attempt report) or every period at the latest."""
    settings = context.settings

    # Silence is counted from the last heartbeat written or from this, whichever is later: the
    # process's start, or the end of a database outage, during which no agent's heartbeat could be
    # written (the agents retry; a node is not lost for the service's own outage).
    up_since = time.time()
    failed = False
    stragglers = Watch()  # each attempt's straggler score, kept from tick to tick

    def tick_once() -> float | None:
        nonlocal up_since, failed
        if failed:
            up_since = time.time()
        now = time.time()
        with context.sessions() as session:
            scheduler.decide(session, settings, now, up_since=up_since)
            session.commit()  # a new attempt's launches go out now, not after the upkeep below
            due = scheduler.tend(session, settings, now)
            session.commit()
        stragglers.run(context.sessions, settings, time.time())  # outside the tick's transaction
        failed = False
        return due

    while not stop.is_set():
        wait = settings.scheduler_period_seconds
        try:
            due = await run_in_threadpool(tick_once)
            if due is not None:  # a lost node's grace ends sooner: its restart waits for no period
                wait = min(wait, max(0.0, due - time.time()))
        except Exception:
            failed = True
            log.exception("scheduler tick failed; retrying next period")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), wait)
        wake.clear()


async def run_slurm_bridge(context: ServiceContext, stop: asyncio.Event) -> None:
    """A pass of the Slurm bridge every ETT_SLURM_POLL_SECONDS; the scheduler is woken after each,
    since a started allocation's agents or an ended one's attempt may need it."""
    settings = context.settings
    bridge = SlurmBridge(context.sessions, settings)
    while not stop.is_set():
        try:
            await run_in_threadpool(bridge.sync)
        except Exception:
            log.exception("Slurm pass failed; retrying next period")
        context.wake_scheduler()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), settings.slurm_poll_seconds)


NOTIFY_PERIOD_SECONDS = 0.5


async def run_notifier(context: ServiceContext, stop: asyncio.Event) -> None:
    """Sends the jobs' due notifications (service/webhooks/notifications.py): each try is a task of its
    own, so a receiver that is down or slow holds up only its own deliveries, never the scheduler's
    ticks or another receiver's."""

    def claim() -> list[notifications.Outgoing]:
        with context.sessions() as session:
            return notifications.claim_due(session, time.time())

    def record(delivery: str, error: str | None) -> None:
        with context.sessions() as session:
            notifications.record_outcome(session, delivery, error, time.time())
            session.commit()

    async def send(client: httpx.AsyncClient, outgoing: notifications.Outgoing) -> None:
        try:
            response = await client.post(outgoing.url, content=outgoing.body, headers=outgoing.headers)
            error = None if response.is_success else f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        await run_in_threadpool(record, outgoing.id, error)

    in_flight: set[asyncio.Task] = set()
    async with httpx.AsyncClient(timeout=context.settings.notify_timeout_seconds, follow_redirects=False) as client:
        while not stop.is_set():
            try:
                for outgoing in await run_in_threadpool(claim):
                    task = asyncio.create_task(send(client, outgoing))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
            except Exception:
                log.exception("notifications pass failed; retrying next period")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), NOTIFY_PERIOD_SECONDS)
        for task in in_flight:  # a delivery cut off here is sent again once its lease ends
            task.cancel()


class YoungCollector:
    """Runs Python's cyclic garbage collector on a clock instead of on allocation counts.

    Under load, counted collections (every 50,000 net allocations) paused the whole process for
    up to 210 ms: a batch of events allocates tens of thousands of objects that live until it is
    answered, and each collection triggered by the count walked all those in flight, and freed the
    garbage of the many requests before it, in one go. On the clock, the youngest generation is
    collected every `period` seconds (7 ms on average in the load bench, 48 ms at most), however
    fast the load allocates. The older generations, which hold every open connection's state (two
    per agent), are walked rarely: only cyclic garbage that outlived its request waits there
    (BENCHMARKS.md, "Load"). The counted collector stays on with a high threshold, as a backstop
    for a loop too busy to keep the clock.
    """

    def __init__(self, period: float = 0.25, middle_every: int = 20, full_every: int = 240) -> None:
        self.period, self.middle_every, self.full_every = period, middle_every, full_every

    async def run(self) -> None:
        gc.freeze()  # the startup heap (imports, the app) never becomes garbage: out of every pass
        gc.set_threshold(200_000, 10, 10)
        passes = 0
        while True:
            await asyncio.sleep(self.period)
            passes += 1
            gc.collect(2 if passes % self.full_every == 0 else 1 if passes % self.middle_every == 0 else 0)
