"""Group commit, written once: requests wait on the event loop, a task takes them in groups and
writes each group in one transaction on a worker thread; each request still gets its own answer.

The heartbeats (service/jobs/heartbeats.py) and the agents' event batches
(service/ingest/batches.py) only say what a group writes. A group whose write fails is written
again one request at a time, so an error, and the nothing-stored of a refused request, stay with
the request that caused them.
"""

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.to_thread

from service.db import retry_on_disconnect

log = logging.getLogger("ett.group_commit")


class Request(Protocol):
    answer: asyncio.Future[Any]


T = TypeVar("T", bound=Request)


class Waiting(Generic[T]):
    """Requests waiting for the next group of one lane, and the signal that some arrived.

    A group is taken at most every `pace` seconds. A group's own cost (its transaction's few
    statements: 2 to 4 ms of CPU whatever its size) is then paid at most 1/pace times a second,
    however the requests arrive. Without it, a moderate load made many groups of one or two
    requests, whose fixed costs kept the process busy and slowed every request. A request
    that arrives after a quiet `pace` is taken at once: no delay on an idle service.
    """

    def __init__(self, pace: float = 0.0) -> None:
        self.items: list[T] = []
        self.arrived = asyncio.Event()
        self.pace = pace
        self.last_taken = -math.inf

    def put(self, item: T) -> None:
        self.items.append(item)
        self.arrived.set()

    async def take(self, most: int) -> list[T]:
        while not self.items:
            self.arrived.clear()
            await self.arrived.wait()
        loop = asyncio.get_running_loop()
        if (wait := self.last_taken + self.pace - loop.time()) > 0:
            await asyncio.sleep(wait)  # the requests that arrive meanwhile join this group
        self.last_taken = loop.time()
        group, self.items = self.items[:most], self.items[most:]
        return group

    def cancel_all(self) -> None:
        for item in self.items:
            item.answer.cancel()


def answer(item: Request, outcome: Any) -> None:
    """Gives a request its result, or raises its exception in it; nothing when its client went away."""
    if item.answer.done():
        return
    if isinstance(outcome, Exception):
        item.answer.set_exception(outcome)
    else:
        item.answer.set_result(outcome)



class GroupWriter(Generic[T]):
    """One lane of group commit.

    `write` runs on a worker thread (of `threads`) and returns one outcome per request of the
    group: its result, an exception to raise in it, or None when this lane cannot write it now
    (it is handed to `unplaced`). When `write` raises, the group is written again one request at
    a time; a request that fails alone gets `refused(request, error)` (default: the error itself,
    logged), so one bad request never fails the others.
    """

    def __init__(
        self,
        write: Callable[[list[T]], Sequence[Any]],
        threads: anyio.CapacityLimiter,
        *,
        most: int,
        pace: float = 0.0,
        unplaced: Callable[[T], None] | None = None,
        refused: Callable[[T, Exception], Any] | None = None,
    ) -> None:
        self.write, self.threads, self.most = write, threads, most
        self.waiting: Waiting[T] = Waiting(pace)
        self.unplaced = unplaced
        self.refused = refused or _log_and_return

    def put(self, item: T) -> None:
        self.waiting.put(item)

    async def run(self) -> None:
        """The lane's task (cancel to stop; the requests still waiting then fail)."""
        try:
            while True:
                group = await self.waiting.take(self.most)
                for item, outcome in zip(group, await self._write(group), strict=True):
                    if outcome is not None:
                        answer(item, outcome)
                    elif not item.answer.done():
                        assert self.unplaced is not None, "only a lane with somewhere to send them leaves requests"
                        self.unplaced(item)
        finally:
            self.waiting.cancel_all()

    async def _write(self, group: list[T]) -> Sequence[Any]:
        try:
            write = partial(retry_on_disconnect, partial(self.write, group))
            return await anyio.to_thread.run_sync(write, limiter=self.threads)
        except Exception as exc:
            if len(group) == 1:
                return [self.refused(group[0], exc)]
        # One request broke the group: write them one by one, so only that one fails.
        return [outcome for item in group for outcome in await self._write([item])]


def _log_and_return(item: Request, error: Exception) -> Exception:
    log.error("%s failed", type(item).__name__, exc_info=error)
    return error
