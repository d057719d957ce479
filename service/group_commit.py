"""What the two group writers share (service/heartbeats.py, service/event_batches.py): requests
waiting on the event loop for the next group, and handing each its own outcome."""

import asyncio
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar


class Request(Protocol):
    answer: asyncio.Future[Any]


T = TypeVar("T", bound=Request)


class Waiting(Generic[T]):
    """Requests waiting for the next group of one lane, and the signal that some arrived."""

    def __init__(self) -> None:
        self.items: list[T] = []
        self.arrived = asyncio.Event()

    def put(self, item: T) -> None:
        self.items.append(item)
        self.arrived.set()

    async def take(self, most: int) -> list[T]:
        while not self.items:
            self.arrived.clear()
            await self.arrived.wait()
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
