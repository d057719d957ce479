"""How long this rank waited for its peers inside a step: its blocking waits on collectives, timed
(docs/library.md, "Per-rank timing"). ett/timing.py takes them off the step to get the rank's work.

Why waits and not one mark: with FSDP2 (ZeRO-3, ZeRO-2) every layer's all-gather, in forward
and again in backward, waits for the slowest rank, so a fast rank ends its backward at the same
moment as a slow one (measured: 63 ms on both of 2 gloo ranks, one of them sleeping 40 ms in its
forwards); what differs is how long each was blocked (52 ms against 12 ms). Expert parallelism's
all-to-alls do the same.

What is timed, once the Run installs it (a job of several ranks; nothing outside a job):
- `Work.wait()` of torch.distributed: every collective called through its Python API, blocking
  (`dist.all_reduce(t)` waits in it) or not (FSDP2's all-gathers and reduce-scatters on CPU);
- on CUDA also `torch.cuda.Stream.wait_event`, where FSDP2 makes the compute stream wait for
  the streams of its all-gathers and reduce-scatters.
Only the step's own waits count: those on the thread that opened the step, or in its backward
(autograd's own threads on CUDA); an asynchronous checkpoint's collectives on its thread do not.
Not seen: waits inside C++ (DDP's reducer, which DDPWatch marks instead; functional collectives,
as DTensor's `full_tensor`).

The clocks: on CPU wall-clock seconds; on CUDA, events recorded on the step's stream before and
after each wait, read only once the GPU has passed them (Event.query, never a synchronize in
the step): the stream's stall, where the host may have run far ahead.
"""

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

_WORK_WAIT = dist.Work.wait  # torch's own, put back when the last listener stops


class WallClock:
    """Points in time on this host (CPU ranks)."""

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(begin: float, end: float) -> float:
        return end - begin

    @staticmethod
    def done(_point: float) -> bool:
        return True


class CudaClock:
    """Points in time on one CUDA stream (the step's): events, recorded as the host reaches them
    and passed when the GPU does. Recording costs a few microseconds and never waits."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream

    def now(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    @staticmethod
    def seconds(begin: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # passed already (TimingWindow reads ready steps), but at the run's end
        return begin.elapsed_time(end) / 1000

    @staticmethod
    def done(point: torch.cuda.Event) -> bool:
        return point.query()


WALL = WallClock()


def clock_for_step() -> WallClock | CudaClock:
    """The GPU's clock where the rank computes on one (CUDA in use), else the host's."""
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    return CudaClock(torch.cuda.current_stream()) if in_use else WALL


class StepSpan:
    """One step's points on its clock: its start, its waits (begin, end) and, where something
    marked it, the point where the rank reached the step's synchronisation."""

    def __init__(self, clock: WallClock | CudaClock):
        self.clock = clock
        self.thread = threading.get_ident()
        self.stream = clock.stream if isinstance(clock, CudaClock) else None
        self.start: Any = clock.now()
        self.waits: list[tuple[Any, Any]] = []
        self.mark: Any = None
        self.waits_before_mark = 0
        self.end: Any = None
        self.waits_timed = False  # whether a CollectiveWaits listened: without it, no wait is known

    def counts_here(self) -> bool:
        """A wait of this step: on its thread, or in a backward (on CUDA, autograd's thread)."""
        return threading.get_ident() == self.thread or torch._C._current_graph_task_id() != -1

    def stalls_own_stream(self) -> bool:
        """On CUDA, whether a wait now holds up the step's stream (FSDP2 also waits on its own
        all-gather stream, which overlaps the compute)."""
        return self.stream is None or torch.cuda.current_stream() == self.stream

    def marked(self) -> None:
        self.mark, self.waits_before_mark = self.clock.now(), len(self.waits)

    def ready(self) -> bool:
        """Whether the clock has passed every point read (always, on the host's)."""
        last = self.mark if self.mark is not None else self.end
        return self.clock.done(last) and all(self.clock.done(end) for _, end in self.waits[-1:])

    def work(self) -> float | None:
        """Seconds of the step before its mark (its end, where waits are timed and nothing marked
        it) less those spent waiting on collectives before then; None: not known."""
        if self.mark is not None:
            until, waits = self.mark, self.waits[: self.waits_before_mark]
        elif self.waits_timed and self.end is not None:
            until, waits = self.end, self.waits
        else:
            return None
        waited = sum(self.clock.seconds(begin, end) for begin, end in waits)
        return max(0.0, self.clock.seconds(self.start, until) - waited)


class CollectiveWaits:
    """Times the open step's waits on collectives, by wrapping torch's waits (module docstring)
    while it listens. One listener at a time: a second Run in a process takes over."""

    listening: "CollectiveWaits | None" = None

    def __init__(self) -> None:
        self.span: StepSpan | None = None

    def start(self) -> None:
        CollectiveWaits.listening = self
        dist.Work.wait = _timed_work_wait
        if torch.cuda.is_available():
            torch.cuda.Stream.wait_event = _timed_wait_event

    def stop(self) -> None:
        self.span = None
        if CollectiveWaits.listening is self:
            CollectiveWaits.listening = None
            dist.Work.wait = _WORK_WAIT
            if torch.cuda.is_available():
                torch.cuda.Stream.wait_event = _STREAM_WAIT_EVENT


def _open_span() -> StepSpan | None:
    listener = CollectiveWaits.listening
    span = listener.span if listener is not None else None
    return span if span is not None and span.counts_here() else None


def _timed_work_wait(work: dist.Work, *args: Any, **kwargs: Any) -> Any:
    span = _open_span()
    if span is None or not span.stalls_own_stream():
        return _WORK_WAIT(work, *args, **kwargs)
    begin = span.clock.now()
    try:
        return _WORK_WAIT(work, *args, **kwargs)
    finally:
        span.waits.append((begin, span.clock.now()))


_STREAM_WAIT_EVENT = torch.cuda.Stream.wait_event


def _timed_wait_event(stream: torch.cuda.Stream, event: Any) -> None:
    """The step's stream waiting for another's event (FSDP2: its all-gather, its reduce-scatter)."""
    span = _open_span()
    if span is None or span.stream is None or stream != span.stream:
        return _STREAM_WAIT_EVENT(stream, event)
    begin = span.clock.now()
    _STREAM_WAIT_EVENT(stream, event)
    span.waits.append((begin, span.clock.now()))
