"""`ett.init()` and `Run`: what a training script calls to get ETT's accounting, checkpoints and
resume (docs/library.md).

    with ett.init() as run:
        with run.initializing():
            model, optimizer = build()
        state = {"app": ett.ModelOptimizerState(model, optimizer)}
        start = run.restore(state)
        for step in range(start + 1, steps + 1):
            with run.step(step, tokens=tokens_per_step) as s:
                s.loss = train_step()
            run.checkpoint(step, state, force=step == steps)

Inside an ETT job the agent's environment (ett/env.py) says where events go, which folder holds
the job's checkpoints and which one to resume from. Outside one every call still works: events
go nowhere, and checkpoints are saved only where the script names a folder.
"""

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ett.checkpoint import CheckpointConfig, Checkpointer
from ett.elastic import ElasticPlan
from ett.env import JobEnvironment
from ett.errors import UsageError
from ett.events import EventWriter
from ett.faults import faults_of, set_off, slowdown_of
from ett.imports import write_imports
from ett.checkpoints.folders import step_of
from ett.framework import FrameworkHooks
from ett.paths import inside
from ett.protocol import EXIT_STOPPED, RANK_KINDS
from ett.timing import DDPWatch, SyncClock, TimingWindow
from ett.waits import StepSpan

logger = logging.getLogger("ett")


class Stopped(SystemExit):
    """Raised by `run.checkpoint` once the job was told to stop (SIGTERM: Slurm's time limit or
    preemption, the agent's stop) and the final checkpoint is committed: the script exits with
    EXIT_STOPPED, which tells the service it stopped cleanly."""

    def __init__(self) -> None:
        super().__init__(EXIT_STOPPED)


def _check_writable(folder: str) -> None:
    probe = Path(folder) / f".ett-write-probe-{os.getpid()}"
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"checkpoint folder {folder} cannot be written: {exc.strerror or exc}") from None


def _ignore_late_sigterm() -> None:
    """This rank stops after a final checkpoint; a later SIGTERM (torchrun tearing the group down
    once a peer has exited) has nothing to add. Python puts its own handlers back to the default
    while the interpreter shuts down, so such a signal would then kill the rank (exit -15, not
    EXIT_STOPPED); an ignored signal stays ignored."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Step:
    """One training step, timed from `with run.step(...)` to its end; set `loss` to report it."""

    def __init__(self, run: "Run", step: int, tokens: int | None):
        self.run, self.step, self.tokens = run, step, tokens
        self.loss: Any = None
        self._start = 0.0
        self._slept = 0.0  # an injected slowdown's sleep (ett/faults.py, slow)
        self.saving = 0.0  # seconds blocked on a save inside the step (run.checkpoint, run.wait_for_staging)

    def __enter__(self) -> "Step":
        fault = self.run._faults.pop(self.step, None)
        if fault is not None:  # a drill's: as the step's own code would fail
            set_off(fault, self.run.rank)
        self._start = time.perf_counter()
        self.run._open_step = self
        self.run._sync.begin()  # its clock points, its collectives' waits (ett/timing.py)
        slow = self.run._slowdown
        if slow is not None and self.step >= slow[0] and self.run._own_seconds:
            self._slept = (slow[1] - 1.0) * self.run._own_seconds
            time.sleep(self._slept)
        return self

    def synchronizing(self) -> None:
        """Marks that this rank has done its own work of the step and now synchronises with its
        peers (its gradient all-reduce): the time until here, less its waits on collectives, is
        its work (ett/timing.py). DDP and FSDP2 scripts are timed without it."""
        self.run._sync.mark()

    def __exit__(self, exc_type, exc, tb) -> None:
        span = self.run._sync.end()
        self.run._open_step = None
        if exc_type is None:  # a step that raised did not happen
            self.run._step_done(self, time.perf_counter() - self._start, span)


class Run(FrameworkHooks):
    """One rank's view of one attempt of a job. Made by `ett.init()`; every rank makes its own.
    A framework's callbacks use the pairs of FrameworkHooks (ett/framework.py)."""

    def __init__(self, env: JobEnvironment, checkpoint_dir: str | None = None, interval_steps: int = 0, keep: int = 3,
                 stop_on_sigterm: bool | None = None):
        self.job_id: str | None = env.job_id
        self.attempt: int = env.attempt
        self.rank: int = env.rank
        self.world_size: int = env.world_size
        self.full_world_size: int = env.full_world_size  # above world_size: an elastic job shrunk
        self.elastic_plan: ElasticPlan | None = None  # run.elastic's: checkpoints of other sizes are loaded
        # The job's folder wins over the script's: the service chose it (and keeps jobs apart).
        self.checkpoint_dir: str | None = env.checkpoint_dir or (str(checkpoint_dir) if checkpoint_dir else None)
        self.resume_from: str | None = env.resume_from
        if self.resume_from and self.checkpoint_dir and not inside(self.resume_from, self.checkpoint_dir):
            # A run resumes from, and prunes, only its own folder.
            logger.warning("ignoring ETT_RESUME_FROM %s: outside the checkpoint folder %s", self.resume_from,
                           self.checkpoint_dir)
            self.resume_from = None
        self.interval_steps: int = env.interval_steps if env.interval_steps is not None else interval_steps
        self.keep: int = env.keep if env.keep is not None else keep
        self._config = CheckpointConfig(
            dir=self.checkpoint_dir or "", local_dir=env.checkpoint_local_dir or "",
            interval_steps=self.interval_steps, keep=self.keep, resume_from=self._dcp_resume_from(),
            async_mode="thread",  # a checkpoint process would re-import the user's script (spawn)
        )  # fmt: skip
        self._config.validate()
        if self.checkpoint_dir:
            _check_writable(self.checkpoint_dir)
        self._events = EventWriter(env.event_dir, env.rank, env.attempt)
        self._faults = faults_of(self.rank)  # injected ones meant for this rank, by step (ett/faults.py)
        self._slowdown = slowdown_of(self.rank)
        self._own_seconds = 0.0  # the last step's time, an injected slowdown's sleep left out
        self._sync = SyncClock(time_waits=self.in_job and self.world_size > 1)
        self._ddp_watch = DDPWatch(self._sync) if self.in_job and self.world_size > 1 else None
        self._timing = TimingWindow(self._events.emit) if self.in_job else None
        self._steps_done = 0
        # This node's local rank 0 says what the script imported, here, when its agent asks: the job's
        # next attempts start warm with them (ett/imports.py). A script has imported its frameworks by
        # now; said at its first step, the server of them (seconds of imports) was not ready for a
        # failure soon after it (the HF example's restart forked from the base server, 10.1 s against 1.9 s).
        if env.learn_imports and env.local_rank == 0 and env.event_dir:
            write_imports(env.event_dir)
        # The job's planned steps, where the script knows them: the service weighs a straggler's
        # cost over the steps left (service/stragglers/). The trainer and the Trainer set it.
        self.total_steps: int | None = None
        self._checkpointer: Checkpointer | None = None
        self._last_step: int | None = None
        self._init_marked = False
        self._pid = os.getpid()
        self._open_step: Step | None = None  # entered (with run.step, begin_step), not ended yet
        self.keys_not_restored: list[str] = []  # what run.restore found saved that `state` has no place for
        self.keys_missing: list[str] = []  # what `state` gave run.restore that the checkpoint lacks
        self._closed = False
        self._sigterm = False  # this rank got SIGTERM
        self._stop_agreed = False  # some rank did, and every rank knows (should_stop)
        wanted = bool(self.in_job and self.checkpoint_dir) if stop_on_sigterm is None else stop_on_sigterm
        self._handles_sigterm = wanted and self._install_sigterm_handler()

    def _install_sigterm_handler(self) -> bool:
        """SIGTERM only sets a flag: the step in progress finishes and a final checkpoint is saved
        (should_stop). A script's own handler is left alone."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False

        def on_sigterm(_signum: int, _frame: object) -> None:
            self._sigterm = True

        self._on_sigterm = on_sigterm
        signal.signal(signal.SIGTERM, on_sigterm)
        return True

    def configure_checkpoints(self, config: CheckpointConfig) -> None:
        """For a script whose checkpoint settings come from its own command line (the built-in
        trainer, whose flags the agent sets from the same job): these settings instead of the
        ones read from the job's environment. Call it before restore and checkpoint."""
        if self._checkpointer is not None:
            raise UsageError("run.configure_checkpoints: call it before run.restore and run.checkpoint")
        config.validate()
        if config.dir:
            _check_writable(config.dir)
        self._config, self.checkpoint_dir = config, config.dir or None
        self.interval_steps, self.keep = config.interval_steps, config.keep

    def _dcp_resume_from(self) -> str:
        """The service's choice when it is one of ours (a step folder; another library's
        checkpoint, as the Trainer's checkpoint-N, is that library's to load), else "auto"."""
        return self.resume_from if self.resume_from and step_of(Path(self.resume_from)) is not None else "auto"

    @property
    def in_job(self) -> bool:
        """True inside an ETT job; False under plain torchrun or in a notebook."""
        return self.job_id is not None

    # -- phases --------------------------------------------------------------------------------

    @contextmanager
    def initializing(self):
        """Start-up: building the model, the optimizer, the data. Only a start-up that finishes
        is marked done."""
        began = self.begin_init()
        yield self
        if began:
            self.end_init()

    def restore(self, state: dict[str, Any]) -> int:
        """Loads, in place, the checkpoint the service named or else the newest committed one that
        verifies in the job's folder; returns its step (0: none, the state is left as it is).
        What the checkpoint holds that `state` has no place for is not loaded (its keys are in
        `run.keys_not_restored`), what `state` holds that the checkpoint lacks keeps its value
        (`run.keys_missing`); both are logged and in the `restore_end` event (ett/checkpoints/state_load.py)."""
        if not self._config.dir:
            return 0
        # What did not match is logged there; a declared elastic run loads a save of another size.
        step, report = self._get_checkpointer().restore(state, other_sizes=self.elastic_plan is not None)
        self.keys_not_restored, self.keys_missing = report.not_restored, report.missing
        self._last_step = step
        return step

    def elastic(self, global_batch: int, micro_batch: int) -> ElasticPlan:
        """Declares that this run keeps its training the same at fewer ranks (ett/elastic.py): the
        plan of this rank at its present size; rank 0 says the sizes (`elastic`) once. Call it
        before run.restore, which then loads a checkpoint saved at another size."""
        plan = ElasticPlan.declare(global_batch, micro_batch, self.world_size, self.full_world_size, self.rank)
        if self.elastic_plan is None and self.rank == 0:
            self._events.emit("elastic", world_sizes=plan.world_sizes, full_world_size=plan.full_world_size)
        self.elastic_plan = plan
        return plan

    def restored(self, step: int, source: str = "persistent") -> None:
        """For a framework that loads its own checkpoints (the Hugging Face Trainer): marks the
        restore done at `step`; steps go on from there."""
        self._events.emit("restore_end", step=step, source=source)
        self._last_step = step

    def step(self, step: int, tokens: int | None = None) -> Step:
        """`with run.step(n) as s:` around one training step; `step` numbers must increase."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise UsageError(f"run.step({step!r}): a step number is an integer >= 1")
        if self._last_step is not None and step <= self._last_step:
            raise UsageError(f"run.step({step}): step numbers must increase; the last step was {self._last_step}")
        return Step(self, step, tokens)

    def _step_done(self, step: Step, duration: float, span: StepSpan | None) -> None:
        self._last_step = step.step
        self._events.progress(step.step)  # every rank: its agent watches it for hangs and faults
        self._own_seconds = max(0.0, duration - step._slept)
        self._steps_done += 1
        if self._ddp_watch is not None:
            self._ddp_watch.step_ended(self._steps_done)
        if self._timing is not None:
            self._timing.add(step.step, duration, span, self.total_steps)
        if self.rank == 0:  # the report takes its timings from rank 0
            data: dict[str, Any] = {"duration": duration}
            if step.tokens is not None:
                data["tokens"] = int(step.tokens)
            if step.loss is not None:
                data["loss"] = float(step.loss.detach() if hasattr(step.loss, "detach") else step.loss)
            if step.saving > 0:
                data["saving"] = step.saving
            self._events.emit("step", step=step.step, **data)

    def checkpoint(self, step: int, state: dict[str, Any], force: bool = False, stop: bool | None = None,
                   wait_for_staging: bool = True) -> bool:
        """Saves `state` when a save is due by the job's interval, or when forced. Returns once the
        state is copied (the write and the commit go on in the background); True when a save started.
        Once the job is told to stop (should_stop), saves this step, waits for the commit and
        raises Stopped: the script exits with EXIT_STOPPED. Every rank calls it at every step.
        `stop`: whether to stop, already agreed over the ranks by the caller (the trainer folds the
        flag into its loss's all-reduce); None asks should_stop. `wait_for_staging=False` returns
        while the state is still being copied: the caller must call run.wait_for_staging() before
        it next changes the state (the trainer: before its optimizer step)."""
        if not self._config.dir:
            return False
        checkpointer, started = self._get_checkpointer(), False
        stop = self.should_stop() if stop is None else self._agree_stop(stop)
        if force or stop or self.checkpoint_due(step):
            with self._saving():
                started = checkpointer.save(step, state)
                if wait_for_staging or stop:
                    checkpointer.wait_for_staging()
        checkpointer.snapshot(step, state)  # with a node-local folder: the fast tier, every step it can
        if stop:
            logger.warning("SIGTERM: stopped after step %d and its checkpoint", step)
            raise Stopped()
        return started

    def wait_for_staging(self) -> None:
        """Returns once a save started by run.checkpoint(..., wait_for_staging=False) has copied
        the state: it may change again."""
        if self._checkpointer is not None:
            with self._saving():
                self._checkpointer.wait_for_staging()

    @contextmanager
    def _saving(self) -> Iterator[None]:
        """Times a save's blocking inside the open step (none: between steps, nothing to take off):
        the step event's `saving`, booked as checkpoint time and never again as slow time."""
        step, start = self._open_step, time.perf_counter()
        try:
            yield
        finally:
            if step is not None:
                step.saving += time.perf_counter() - start

    @property
    def sigterm_received(self) -> bool:
        """This rank got SIGTERM (other ranks may not have: should_stop agrees on it)."""
        return self._sigterm

    def should_stop(self) -> bool:
        """True once any rank of the job got SIGTERM (Slurm's time limit or preemption, the
        agent's stop), on every rank alike: one small all-reduce, so all ranks call it at the
        same step (run.checkpoint does, every step). Always False outside a job."""
        if not self._handles_sigterm or self._stop_agreed:
            return self._stop_agreed
        flag = self._sigterm
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = "cpu" if "gloo" in str(dist.get_backend()) else torch.accelerator.current_accelerator()
            flag_1 = torch.tensor([int(flag)], device=device)
            dist.all_reduce(flag_1, op=dist.ReduceOp.MAX)
            flag = bool(flag_1.item())
        return self._agree_stop(flag)

    def _agree_stop(self, flag: bool) -> bool:
        """Records whether every rank stops after this step (the same on all of them)."""
        self._stop_agreed = flag
        if flag:
            _ignore_late_sigterm()
        return flag

    def checkpoint_due(self, step: int) -> bool:
        """Whether the job's interval asks for a save after `step` (False without a folder)."""
        return self._config.due(step)

    def progress(self) -> None:
        """A liveness mark for long work outside steps (evaluation, data loading): the agent's
        hang detection counts it as progress."""
        self._events.progress(None)

    def emit(self, kind: str, step: int | None = None, **data: Any) -> None:
        """Writes one rank event of the schema (docs/events.md), for an integration with a
        framework that saves or loads on its own; the calls above cover a plain loop."""
        if kind not in RANK_KINDS:
            raise UsageError(f"run.emit({kind!r}): a rank writes one of {', '.join(sorted(RANK_KINDS))}")
        self._events.emit(kind, step=step, **data)

    def close(self) -> None:
        """Waits for the last save to be committed, then marks the end of training."""
        if self._closed:
            return
        self._closed = True
        self._stop_watching()
        if self._checkpointer is not None:
            self._checkpointer.close()
        self._events.emit("train_end", step=self._last_step)
        self._events.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or issubclass(exc_type, Stopped):
            self.close()
            if exc_type is None and self._stop_agreed:  # a framework's loop stopped on should_stop
                _ignore_late_sigterm()  # again: the framework may have put its handlers back since
                raise Stopped()
        else:  # a failing run: its events are written out, and a save in flight is not waited for
            self._closed = True
            self._stop_watching()
            self._events.close()

    def _stop_watching(self) -> None:
        self._sync.stop()  # torch's waits as they were
        if self._ddp_watch is not None:
            self._ddp_watch.stop()
        if self._timing is not None:
            self._timing.flush()

    def _get_checkpointer(self) -> Checkpointer:
        if self._checkpointer is None:
            if not dist.is_initialized():
                if self.world_size > 1:
                    raise UsageError(f"this job has {self.world_size} ranks: call torch.distributed.init_process_group "
                                     "before run.restore or run.checkpoint")
                # One process on its own (a notebook, `python train.py`): a one-rank group of our own.
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._checkpointer = Checkpointer(self._config, self._events)
        return self._checkpointer


def init(checkpoint_dir: str | os.PathLike | None = None, interval_steps: int = 0, keep: int = 3,
         stop_on_sigterm: bool | None = None) -> Run:
    """The Run of this rank. Inside an ETT job the job's settings win; the arguments are what the
    script uses elsewhere: the folder to save into and resume from, save every `interval_steps`
    steps (0: only forced saves), keep the newest `keep`. `stop_on_sigterm`: SIGTERM asks for a
    stop after the step in progress and a final checkpoint (should_stop); None: inside a job
    that checkpoints (elsewhere SIGTERM ends the script as usual)."""
    return Run(JobEnvironment.from_environ(), checkpoint_dir, interval_steps, keep, stop_on_sigterm)
