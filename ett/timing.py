"""Per-rank step timing (docs/library.md, "Per-rank timing"): how long each rank worked in a step,
apart from the time it waited for its peers.

In a synchronous job every rank leaves the gradient synchronisation at the same moment, so the
step's length says nothing of which rank held the others up; the time each one spent waiting
does. A rank's work in a step is its time up to its synchronisation mark (the step's end where
nothing marks it), less the time it was blocked in collectives before then (ett/waits.py):

- FSDP2 and other scripts whose collectives go through torch.distributed's Python API: their
  waits are timed, the rest of the step is work; nothing to call;
- a script on DistributedDataParallel (the Hugging Face Trainer's too), whose reducer waits in
  C++: the first forward of a DDP module hooks the gradient of its first parameters, which
  backward computes last: the end of this rank's backward, where it waits for the last all-reduce;
- the built-in trainer marks the end of its backward (trainer/train.py); `step.synchronizing()`
  marks such a point in any script.

Every `WINDOW` steps each rank writes one `step_timing` event: the window's median step time,
median work and second-lowest work. The service compares ranks against their peers and their own
history (service/stragglers/).
"""

import statistics
from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from ett.waits import CollectiveWaits, StepSpan, clock_for_step

WINDOW = 5  # steps per step_timing event: at 16,384 ranks and a step a second, 3,277 events/s
LOOKOUT_STEPS = 3  # with no DDP module seen in this many steps, stop looking (the hook costs a call per module)
FIRST_PARAMETERS = 2  # of a DDP module, whose gradients mark the end of its backward


class SyncClock:
    """This rank's open step (its StepSpan: start, waits, mark), marked by any marker; with
    `time_waits` its collectives' waits are timed from the first step to `stop`."""

    def __init__(self, time_waits: bool = False) -> None:
        self.span: StepSpan | None = None
        self._waits = CollectiveWaits() if time_waits else None
        if self._waits is not None:
            self._waits.start()

    def begin(self) -> None:
        self.span = StepSpan(clock_for_step())
        if self._waits is not None:
            self.span.waits_timed = True
            self._waits.span = self.span

    def mark(self) -> None:
        if self.span is not None:  # a hook's mark outside a step (an evaluation's backward) tells nothing
            self.span.marked()

    def end(self) -> StepSpan | None:
        span, self.span = self.span, None
        if self._waits is not None:
            self._waits.span = None
        if span is not None:
            span.end = span.clock.now()
        return span

    def stop(self) -> None:
        if self._waits is not None:
            self._waits.stop()


class DDPWatch:
    """Finds the DDP modules a script runs (a global forward pre-hook, removed once one is found
    or after LOOKOUT_STEPS steps) and marks `clock` when the gradient of their first parameters
    is accumulated: backward computes it last, so the rank has then done its step's work and
    waits for its last bucket's all-reduce. A post-accumulate-grad hook on two parameters, not a
    communication hook: a Python hook in place of DDP's built-in all-reduce cost 6% of a 19 ms
    step in bench/stragglers.py, and a script may have its own."""

    def __init__(self, clock: SyncClock) -> None:
        self.clock = clock
        self.found = False
        self._handle: RemovableHandle | None = nn.modules.module.register_module_forward_pre_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, _args: Any) -> None:
        if not isinstance(module, DistributedDataParallel) or getattr(module, "_ett_timed", False):
            return
        module._ett_timed = True  # type: ignore[attr-defined]
        first = [p for p in module.module.parameters() if p.requires_grad][:FIRST_PARAMETERS]
        for parameter in first:
            parameter.register_post_accumulate_grad_hook(lambda _p: self.clock.mark())
        self.found = bool(first)
        self.stop()

    def step_ended(self, steps_done: int) -> None:
        if not self.found and steps_done >= LOOKOUT_STEPS:
            self.stop()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class TimingWindow:
    """A rank's step times and work times, summarised every WINDOW steps by `emit`."""

    def __init__(self, emit: Callable[..., None]) -> None:
        self._emit = emit
        self._steps: list[tuple[int, float, float | StepSpan | None]] = []
        self._total_steps: int | None = None
        self._due = False

    def add(self, step: int, duration: float, work: float | StepSpan | None, total_steps: int | None = None) -> None:
        """One step's time and work (seconds, or its StepSpan to read once its clock has passed
        it: a CUDA step's, a step or so later); `total_steps`: the job's planned steps, where the
        script knows them."""
        self._steps.append((step, duration, work))
        self._total_steps = total_steps
        self._due = self._due or step % WINDOW == 0 or len(self._steps) >= 2 * WINDOW
        if self._due and all(w.ready() for _, _, w in self._steps if isinstance(w, StepSpan)):
            self.flush()

    def flush(self) -> None:
        """Writes the window; a CUDA step's events not passed yet are waited for (at the run's end)."""
        self._due = False
        if not self._steps:
            return
        steps, durations, spans = zip(*self._steps)
        works = [w.work() if isinstance(w, StepSpan) else w for w in spans]
        data: dict[str, Any] = {"first_step": steps[0], "steps": len(steps), "duration": statistics.median(durations)}
        if all(w is not None for w in works):
            data["work"] = statistics.median(works)
            # Its second-fastest step: what a rank slow at every step shows and a few hiccups
            # (another process taking the core for a moment) do not.
            data["work_low"] = sorted(works)[1] if len(works) > 2 else min(works)
        if self._total_steps is not None:
            data["total_steps"] = self._total_steps
        self._emit("step_timing", step=steps[-1], **data)
        self._steps = []
