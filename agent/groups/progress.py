"""What an attempt's ranks say of their progress, and when their silence is a hang (docs/agent.md,
"Hang detection"): their event spools (steps, checkpoint saves, the end of training) and their
progress marks (ett/events.py), read at each poll of the group, held to the limit of agent.groups.hang.
The group acts on a hang (agent.groups.workers); this only says when there is one, and why.
"""

from collections.abc import Callable
from pathlib import Path

from agent.confinement.procs import a_thread_runs_or_waits_on_io, tree_cpu_and_states
from agent.files.spool import SpoolReader
from agent.groups.hang import FrozenRanks, HangLimit
from ett.events import read_progress_mark
from ett.protocol import FROZEN_SECONDS, PROGRESS_GLOB, RANK_SPOOL_GLOB, STOPPED_SECONDS, rank_of_progress_file
from ett.protocol.messages import LaunchCommand

# (phase, seconds waited, limit, detail) of a hang
Hang = tuple[str, float, float, str]


class Progress:
    def __init__(self, command: LaunchCommand, events_dir: Path, now: float) -> None:
        self.command = command
        self.events_dir = events_dir
        self.launched_at = self.last_progress = now
        self.last_step: int | None = None
        self.hang_limit = HangLimit(command.hang_timeout_seconds)  # adaptive once steps are seen (hang.py)
        self.frozen = FrozenRanks()  # ranks whose pulse and CPU time stand still (hang.py)
        self._saving: set[str] = set()  # sources (ranks) in a checkpoint's blocking part
        self._marks: dict[str, tuple[int, ...]] = {}
        # Per rank: events its writer could not write yet (a full disk), and events it dropped.
        self.spool_trouble: dict[str, tuple[int, int]] = {}
        self._marked_at: float | None = None  # the last change of any rank's progress mark
        self._spool = SpoolReader()

    def launched(self, now: float) -> None:
        """The group's processes started now: the init timeout counts from here."""
        self.launched_at = self.last_progress = now

    def read(self, now: float, live: dict[int, int]) -> None:
        """Reads what the ranks wrote since the last call; `live`: the pids of the ranks not yet exited."""
        for path in sorted(self.events_dir.glob(RANK_SPOOL_GLOB)):
            records = self._spool.read(path)
            if records:
                self.last_progress = now
            for record in records:
                kind, source = record.get("kind"), str(record.get("source"))
                if kind == "step" and source == "rank:0":
                    step = record.get("step")
                    if isinstance(step, int):
                        self.last_step = max(step, self.last_step or 0)
                elif kind == "ckpt_start":
                    self._saving.add(source)
                    self.hang_limit.save_started()
                elif kind in ("ckpt_staged", "ckpt_failed"):
                    self._saving.discard(source)
                elif kind == "train_end":
                    self.hang_limit.ended = True
        # Every rank's progress mark (ett/events.py, "<step> <beats> <unwritten> <dropped> <writing> <pulse>"):
        # nodes without rank 0 see no step events. A new step or beat is progress; a step above 0
        # is a step done; the next two say whether the rank's disk is full; the last whether it
        # writes a checkpoint in the background.
        writing = False
        for path in self.events_dir.glob(PROGRESS_GLOB):
            mark = read_progress_mark(path)
            if mark is None:
                continue
            writing = writing or mark.writing
            self.spool_trouble[path.name] = (mark.unwritten, mark.dropped)
            rank = rank_of_progress_file(path.name)
            if rank is not None:
                # The CPU time of the rank's whole tree: one started through a wrapper (`bash train.sh`)
                # computes in a grandchild while the wrapper waits.
                vitals = tree_cpu_and_states(live[rank]) if rank in live else None
                self.frozen.observe(rank, mark.pulse, vitals[0] if vitals else None, now)
            if (mark.step, mark.beats) != self._marks.get(path.name):
                self._marks[path.name] = (mark.step, mark.beats)
                self.last_progress = self._marked_at = now
                if mark.step > 0:
                    self.last_step = max(mark.step, self.last_step or 0)
        self.hang_limit.set_writing(writing)
        if self.last_step is not None:
            self.hang_limit.stepped(self.last_step, now)
        self.hang_limit.saving = bool(self._saving)

    def hang(self, now: float, rank_pids: dict[int, int], owns: Callable[[int], bool]) -> Hang | None:
        """The hang the group is in by now, if it is in one: a frozen rank, no first step within the
        init timeout, or no progress within the (adaptive) hang limit."""
        if self.command.hang_timeout_seconds is None:  # the job turned hang detection off
            return None
        phase = "init" if self.last_step is None else "train"
        if frozen := self._frozen_rank(now, rank_pids, owns):
            waited, limit, detail = frozen
        elif self.last_step is None:
            # Liveness marks (ett's run.progress) before the first step restart the init timeout.
            since = max(self.launched_at, self._marked_at or 0.0)
            waited, limit = now - since, self.command.init_timeout_seconds
            detail = (f"no first step within the init timeout of {limit:g}s: no rank reported a step or progress "
                      "(a script reports them with ett's run.step and run.progress, docs/library.md; "
                      "hang_timeout_seconds = null turns hang detection off)")
        else:
            waited, limit = now - self.last_progress, self.hang_limit.seconds or 0.0
            ceiling = self.command.hang_timeout_seconds
            how = (f"adaptive: {limit:.2f}s from this attempt's step times, ceiling {ceiling:g}s"
                   if self.hang_limit.adaptive else f"hang timeout {limit:g}s")
            detail = f"no progress for {waited:.1f}s after step {self.last_step} ({how})"
        return (phase, waited, limit, detail) if waited >= limit else None

    def _frozen_rank(self, now: float, rank_pids: dict[int, int],
                     owns: Callable[[int], bool]) -> tuple[float, float, str] | None:
        """(seconds, limit, detail) of a rank of this group that froze (hang.py), by the kernel's word."""
        for rank, seconds in sorted(self.frozen.frozen(now, STOPPED_SECONDS).items()):
            pid = rank_pids[rank]
            vitals = tree_cpu_and_states(pid)
            # A thread held up by the machine (waiting for a CPU on a loaded node, or in a page fault or a
            # stalled write) stops the pulse and CPU time too: that is no freeze, and the limit above judges it.
            if vitals is None or not owns(pid) or a_thread_runs_or_waits_on_io(pid):
                continue
            states = vitals[1]
            # Every process of its tree stopped by a signal: ett/protocol's STOPPED_SECONDS.
            limit = STOPPED_SECONDS if all(state == "T" for state in states) else FROZEN_SECONDS
            if seconds < limit:
                continue
            how = "stopped" if "T" in states else "in a tracing stop" if "t" in states else f"state {states[0]}"
            after = f"after step {self.last_step}" if self.last_step is not None else "before its first step"
            return seconds, limit, (f"rank {rank} frozen {after}: its pulse and CPU time stood still for "
                                    f"{seconds:.1f}s (process {how})")
        return None
