"""How long a training group may go without progress before it is a hang: adaptive, from the
step times this attempt has shown (docs/agent.md, "Hang detection").

A fixed `hang_timeout_seconds` must cover the slowest step of any job, so it waits far too long
on a job whose steps take a second. Once an attempt has made `WARMUP_STEPS` steps, its limit is

    min(hang_timeout_seconds, max(FLOOR_SECONDS, FACTOR x the longest gap between steps seen))

`hang_timeout_seconds` stays the ceiling. While a rank of this node is saving a checkpoint (a
`ckpt_start` not yet followed by `ckpt_staged`) the ceiling applies: a save may block longer than
any step; and once a rank has ended its training (`train_end`), since the teardown of a process
group and of an interpreter with torch is no step either (it took over 3 s under the suite's
load). A gap between steps in which a save started is not a step's time and is left out: a save
that waited for the one before it to commit would otherwise raise the limit for good. And
steps run slower while a checkpoint is written in the background (the ranks' progress marks say
when): the gaps during a write and the others are kept apart, and each limit follows its own,
so a hang between writes is caught as fast as the steps there allow (the ceiling applies in a
regime until it has WARMUP_STEPS gaps). A rank that is slow but alive says so with
`run.progress()` beats (the library) or its progress mark; any progress restarts the wait, so
only silence is measured.

A frozen rank (docs/agent.md, "Hang detection") is caught sooner than any limit: the library's
writer thread counts its progress mark's pulse up every PULSE_SECONDS whatever the training loop
does, so a pulse that stands still for FROZEN_SECONDS while the rank's process uses no CPU time
either means no thread of it runs: stopped (SIGSTOP, a debugger), or blocked in C code that holds
the GIL and waits. Its peers wait for it in their next collective, and nothing will end that. One
the kernel reports stopped by a signal (state T) is taken after STOPPED_SECONDS: nothing else can
hold all its threads still (ett/protocol). A
rank that is slow but live is never taken for it: its pulse goes on while it sleeps, waits on I/O
or waits for its peers, and its CPU time goes up while it computes with the GIL held; nor is one the
machine holds up (a thread of it runnable or in uninterruptible sleep: agent/groups/progress.py). A rank
without a pulse (a script not on the library, or one whose run has closed) is judged by the limit
above only.
"""

from collections import deque
from dataclasses import dataclass

from ett.protocol import FROZEN_SECONDS

WARMUP_STEPS = 5  # steps seen before the limit follows them
FACTOR = 4.0  # a step may take this many times the longest one seen
FLOOR_SECONDS = 3.0  # never less: scheduling noise, a slow first eval
GAPS_KEPT = 50  # the newest gaps between steps: a job's pace may change


class HangLimit:
    def __init__(self, ceiling: float | None) -> None:
        self.ceiling = ceiling  # hang_timeout_seconds; None: no hang detection
        # Gaps between steps, by whether a background write ran during them.
        self._gaps: dict[bool, deque[float]] = {False: deque(maxlen=GAPS_KEPT), True: deque(maxlen=GAPS_KEPT)}
        self._last_step: tuple[int, float] | None = None  # (step, when it was first seen)
        self.saving = False  # a rank of this node is in a checkpoint's blocking part
        self.ended = False  # a rank of this node has ended its training: what is left is teardown
        self.writing = False  # a rank of this node is writing a checkpoint in the background
        self._saved_since_step = False  # a save started in the gap since the last step
        self._wrote_since_step = False  # a background write ran in the gap since the last step

    def save_started(self) -> None:
        """A rank of this node began a checkpoint (its `ckpt_start`)."""
        self._saved_since_step = True

    def set_writing(self, busy: bool) -> None:
        """Whether a rank of this node writes a checkpoint in the background now (its mark)."""
        self.writing = busy
        self._wrote_since_step = self._wrote_since_step or busy

    def stepped(self, step: int, now: float) -> None:
        """The group's newest step, as seen at `now` (called with every newer step)."""
        if self._last_step is not None and step > self._last_step[0]:
            if not self._saved_since_step:
                self._gaps[self._wrote_since_step].append((now - self._last_step[1]) / (step - self._last_step[0]))
            self._saved_since_step, self._wrote_since_step = False, self.writing
        if self._last_step is None or step > self._last_step[0]:
            self._last_step = (step, now)

    @property
    def seconds(self) -> float | None:
        """The limit now (None: no detection)."""
        gaps = self._gaps[self.writing]
        if self.ceiling is None or self.saving or self.ended or len(gaps) < WARMUP_STEPS:
            return self.ceiling
        return min(self.ceiling, max(FLOOR_SECONDS, FACTOR * max(gaps)))

    @property
    def adaptive(self) -> bool:
        return self.seconds != self.ceiling


@dataclass
class _Vitals:
    pulse: int
    cpu_ticks: int
    since: float  # when either last changed


class FrozenRanks:
    """The ranks of this node whose pulse and CPU time stand still, and since when (progress.py judges them)."""

    def __init__(self) -> None:
        self._vitals: dict[int, _Vitals] = {}

    def observe(self, rank: int, pulse: int, cpu_ticks: int | None, now: float) -> None:
        """A rank's pulse (0: none to judge by) and CPU time (None: the process is gone), read at `now`."""
        seen = self._vitals.get(rank)
        if pulse == 0 or cpu_ticks is None:
            self._vitals.pop(rank, None)
        elif seen is None or (seen.pulse, seen.cpu_ticks) != (pulse, cpu_ticks):
            self._vitals[rank] = _Vitals(pulse, cpu_ticks, now)

    def frozen(self, now: float, seconds: float = FROZEN_SECONDS) -> dict[int, float]:
        """{rank: seconds frozen} of the ranks whose pulse and CPU time stood still for `seconds` or more."""
        return {rank: now - v.since for rank, v in self._vitals.items() if now - v.since >= seconds}
