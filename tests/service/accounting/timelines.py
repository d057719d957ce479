"""A small builder for hand-written event timelines (times relative to T0, in seconds)."""

from collections import defaultdict
from typing import Any

from service.accounting.engine import Event

T0 = 1_700_000_000.0


class Timeline:
    def __init__(self, t0: float = T0) -> None:
        self.t0 = t0
        self.events: list[Event] = []
        self._seq: dict[tuple[int, str], int] = defaultdict(int)

    def add(self, kind: str, t: float, attempt: int, source: str, step: int | None = None, **data: Any) -> None:
        seq = self._seq[(attempt, source)]
        self._seq[(attempt, source)] += 1
        self.events.append(Event(kind, self.t0 + t, attempt, source, seq, step, data))

    def service(self, kind: str, t: float, attempt: int, **data: Any) -> None:
        self.add(kind, t, attempt, "service", **data)

    def rank0(self, kind: str, t: float, attempt: int, step: int | None = None, **data: Any) -> None:
        self.add(kind, t, attempt, "rank:0", step, **data)

    def step(self, attempt: int, step: int, start: float, duration: float) -> float:
        self.rank0("step", start + duration, attempt, step, duration=duration, tokens=1024, loss=2.0)
        return start + duration

    def steps(self, attempt: int, first: int, last: int, start: float, duration: float, gap: float = 0.0) -> float:
        """Steps first..last back to back (`gap` idle seconds between); returns the last end."""
        t = start
        for s in range(first, last + 1):
            t = self.step(attempt, s, t, duration) + gap
        return t - gap

    def checkpoint(self, attempt: int, step: int, start: float, staged: float, committed: float | None) -> None:
        self.rank0("ckpt_start", start, attempt, step)
        self.rank0("ckpt_staged", staged, attempt, step)
        if committed is not None:
            self.rank0("ckpt_committed", committed, attempt, step, path=f"/ckpt/step-{step:08d}", bytes=4096, verified=True)

    def start_attempt(
        self, attempt: int, allocated: float, init_end: float, restore: tuple[float, float, int] | None = None
    ) -> None:
        self.service("attempt_allocated", allocated, attempt, nodes=["n1"])
        self.add("workers_launched", allocated + 0.1, attempt, "node:n1")
        self.rank0("init_start", allocated + 0.2, attempt)
        self.add("init_start", allocated + 0.2, attempt, "rank:1")
        self.rank0("init_end", init_end, attempt)
        self.add("init_end", init_end, attempt, "rank:1")
        if restore is not None:
            begin, end, step = restore
            self.rank0("restore_start", begin, attempt, step)
            self.rank0("restore_end", end, attempt, step)
