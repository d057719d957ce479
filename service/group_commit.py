"""What the two group writers share (service/agents/heartbeats.py, service/ingest/batches.py): requests
waiting on the event loop for the next group, and handing each its own outcome."""

import asyncio
import math
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar


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


def answer_all(items: Sequence[Request], outcomes: Sequence[Any]) -> None:
    for item, outcome in zip(items, outcomes, strict=True):
        answer(item, outcome)
