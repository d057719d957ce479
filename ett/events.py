"""Schema-v1 events (docs/events.md) appended as JSONL to this rank's spool file, which the agent tails.

`emit` only stamps the event and puts it on a queue (a few microseconds); a background thread
serialises, writes and flushes each line, so the agent sees it within milliseconds and a slow
disk never stalls a training step.

Only rank 0 sends `step` events, so every rank also keeps a progress mark: its last finished
step, a count of liveness beats (work outside steps, `Run.progress`), the spool's state, whether
a checkpoint of the rank is being written in the background (steps are slower then), and a pulse
the writer thread counts up every PULSE_SECONDS while the process runs (0 once closed),
`"<step> <beats> <unwritten> <dropped> <writing> <pulse>"` overwritten in place in
`progress-rank-{RANK}` beside the spool. It is not an event and is not forwarded; the agent of each
node reads it to detect hangs (a new step or beat is progress; a pulse that stops with the
process's CPU time is a frozen rank), to time faults of its own ranks (by the step), and to report
a full disk.

A full disk loses no event: the lines that cannot be written wait in memory, in order, and are
written when space returns; only past MAX_UNWRITTEN_BYTES are lines dropped, and counted. The
mark's bytes exist from the start, so overwriting it needs no free space.
"""

import collections
import json
import os
import queue
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Unpack, overload

from ett.errors import UsageError
from ett.protocol import PULSE_SECONDS, progress_file, rank_spool
from ett.protocol.event_fields import (
    FIELD_NAMES,
    CkptCommittedData,
    CkptFailedData,
    ElasticData,
    InitStartData,
    RestoreEndData,
    StepData,
    StepTimingData,
)

_CLOSE = object()
PROGRESS_WIDTH = 64  # fixed, so an overwrite never leaves digits of a longer mark behind
# A full disk: lines wait in memory up to this many bytes (dropped and counted past it), and are
# tried again at every pulse (PULSE_SECONDS); closing waits at most CLOSE_RETRY_SECONDS for space,
# trying every RETRY_SECONDS.
MAX_UNWRITTEN_BYTES = 16 << 20
RETRY_SECONDS = 0.5
CLOSE_RETRY_SECONDS = 5.0


def make_event(kind: str, ts: float, attempt: int, source: str, seq: int, step: int | None = None,
               data: dict | None = None) -> dict:
    """One schema-v1 event (docs/events.md) as written to a spool or ingested: the one place its
    fields are named, for the ranks, the agents and the service. `data`: the kind's own fields, of
    its type in ett/protocol/event_fields.py (EVENT_FIELDS)."""
    return {"kind": kind, "ts": ts, "attempt": attempt, "source": source, "seq": seq, "step": step,
            "data": data if data is not None else {}}


class EventWriter:
    def __init__(self, spool_dir: str | None, rank: int, attempt: int):
        self.source = f"rank:{rank}"
        self.attempt = attempt
        self.path = Path(spool_dir) / rank_spool(rank) if spool_dir else None
        self.progress_path = Path(spool_dir) / progress_file(rank) if spool_dir else None
        self._lock = threading.Lock()  # seq order must equal file order across emitting threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._mark = (0, 0, 0)  # (last step, beats, writing): the progress mark
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._seq = self._next_seq_in(self.path)
            # The mark with its first pulse is written before this returns, not by the thread: a rank that
            # freezes at once (SIGSTOP, C code holding the GIL) is judged by it before the thread ever ran.
            spool = _Spool(self.path)
            mark_fd = os.open(self.progress_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _write_mark(mark_fd, self._mark, spool, 1)  # its bytes exist from now on: overwriting needs no free space
            self._thread = threading.Thread(target=self._write_loop, args=(spool, mark_fd), name="ett-events",
                                            daemon=True)
            self._thread.start()

    # Each rank kind's fields, as typed in ett/protocol/event_fields.py. Any kind is taken (Run.emit's,
    # checked against RANK_KINDS there); a declared kind's undeclared field is refused.
    @overload
    def emit(self, kind: Literal["init_end", "restore_start", "ckpt_start", "ckpt_staged", "train_end"],
             step: int | None = None) -> None: ...
    @overload
    def emit(self, kind: Literal["init_start"], step: None = None, **data: Unpack[InitStartData]) -> None: ...
    @overload
    def emit(self, kind: Literal["restore_end"], step: int, **data: Unpack[RestoreEndData]) -> None: ...
    @overload
    def emit(self, kind: Literal["step"], step: int, **data: Unpack[StepData]) -> None: ...
    @overload
    def emit(self, kind: Literal["ckpt_committed"], step: int, **data: Unpack[CkptCommittedData]) -> None: ...
    @overload
    def emit(self, kind: Literal["ckpt_failed"], step: int, **data: Unpack[CkptFailedData]) -> None: ...
    @overload
    def emit(self, kind: Literal["step_timing"], step: int, **data: Unpack[StepTimingData]) -> None: ...
    @overload
    def emit(self, kind: Literal["elastic"], step: None = None, **data: Unpack[ElasticData]) -> None: ...

    def emit(self, kind: str, step: int | None = None, **data: Any) -> None:
        fields = FIELD_NAMES.get(kind)
        if fields is not None and not fields.issuperset(data):  # a set lookup: nothing next to a step
            unknown = ", ".join(sorted(data.keys() - fields))
            raise UsageError(f"a {kind} event has no field {unknown} (ett/protocol/event_fields.py)")
        if self._thread is None:
            return
        with self._lock:
            self._queue.put(make_event(kind, time.time(), self.attempt, self.source, self._seq, step, data))
            self._seq += 1

    def progress(self, step: int | None = None) -> None:
        """Marks `step` done on this rank, or (None) only that the rank is alive and working
        (for the agent; see the module's docstring)."""
        if self._thread is not None:
            with self._lock:
                last_step, beats, writing = self._mark
                self._mark = (last_step, beats + 1, writing) if step is None else (step, beats, writing)
                self._queue.put(self._mark)

    def writing(self, busy: bool) -> None:
        """Marks that a checkpoint of this rank is (or no longer is) being written in the
        background: the agent then compares step times with those of earlier writes."""
        if self._thread is not None:
            with self._lock:
                self._mark = (*self._mark[:2], int(busy))
                self._queue.put(self._mark)

    def close(self) -> None:
        """Write out everything emitted so far and stop the writer thread."""
        if self._thread is not None:
            self._queue.put(_CLOSE)
            self._thread.join()
            self._thread = None

    def _next_seq_in(self, path: Path) -> int:
        """A restarted rank of the same attempt appends to its spool: continue after its last seq."""
        last = -1
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:  # a line torn by a kill
                    continue
                if isinstance(event, dict) and event.get("attempt") == self.attempt:
                    last = max(last, int(event.get("seq", -1)))
        return last + 1

    def _write_loop(self, spool: "_Spool", fd: int) -> None:
        mark, pulse, next_pulse = (0, 0, 0), 1, time.monotonic() + PULSE_SECONDS
        try:
            closing = False
            while not closing:
                try:  # the pulse's pace; while lines wait for space, they are tried again as often
                    items = [self._queue.get(timeout=max(0.0, next_pulse - time.monotonic()))]
                except queue.Empty:
                    items = []
                if time.monotonic() >= next_pulse:
                    pulse, next_pulse = pulse + 1, time.monotonic() + PULSE_SECONDS
                while True:  # write whatever else is already queued at once
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                closing = _CLOSE in items
                marks = [item for item in items if isinstance(item, tuple)]
                mark = marks[-1] if marks else mark
                spool.add(json.dumps(item).encode() + b"\n" for item in items if isinstance(item, dict))
                spool.write()
                _write_mark(fd, mark, spool, 0 if closing else pulse)
            deadline = time.monotonic() + CLOSE_RETRY_SECONDS
            while spool.pending and time.monotonic() < deadline:  # a last chance for space to return
                time.sleep(RETRY_SECONDS)
                spool.write()
                _write_mark(fd, mark, spool, 0)
        finally:
            os.close(fd)
            spool.close()


@dataclass(frozen=True)
class ProgressMark:
    step: int  # the rank's last finished step (0: none yet)
    beats: int  # liveness beats outside steps
    unwritten: int  # events waiting for disk space
    dropped: int  # events dropped past the bound
    writing: bool = False  # a checkpoint of the rank is being written in the background
    pulse: int = 0  # counts up while the rank's library runs; 0: closed, or a library without it


def read_progress_mark(path: Path) -> ProgressMark | None:
    """A rank's progress mark as `_write_mark` wrote it; None while it cannot be read. Read by the
    agent, as root, in the job's folder: never through a link, never blocking, PROGRESS_WIDTH bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            raw = os.read(fd, PROGRESS_WIDTH) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        finally:
            os.close(fd)
        fields = [int(field) for field in raw.split()]
    except (OSError, ValueError):
        return None
    if len(fields) < 2:
        return None
    unwritten, dropped = fields[2:4] if len(fields) >= 4 else (0, 0)
    return ProgressMark(fields[0], fields[1], unwritten, dropped, len(fields) >= 5 and fields[4] == 1,
                        fields[5] if len(fields) >= 6 else 0)


def _write_mark(fd: int, mark: tuple[int, int, int], spool: "_Spool", pulse: int) -> None:
    """`<step> <beats> <unwritten> <dropped> <writing> <pulse>` in place: the agent reads it (agent/groups/workers.py)."""
    text = f"{mark[0]} {mark[1]} {len(spool.pending)} {spool.dropped} {mark[2]} {pulse}"
    text = text.rjust(PROGRESS_WIDTH).encode()
    try:
        os.pwrite(fd, text, 0)
    except OSError:
        pass  # the mark's own bytes exist already; a failure here is the disk's, seen by the spool too


class _Spool:
    """A rank's spool file, and the lines that could not be written to it yet (a full disk),
    kept in order up to MAX_UNWRITTEN_BYTES; lines past that bound are dropped and counted."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pending: collections.deque[bytes] = collections.deque()
        self.pending_bytes = 0
        self.dropped = 0
        self.partial = False  # the first pending line is the rest of a line written in part
        if os.fstat(self.fd).st_size > 0:
            with open(path, "rb") as existing:  # a kill may have left a partial last line: start a fresh one
                existing.seek(-1, os.SEEK_END)
                if existing.read(1) != b"\n":
                    self.add([b"\n"])

    def add(self, lines: Iterable[bytes]) -> None:
        for line in lines:
            if self.pending_bytes + len(line) > MAX_UNWRITTEN_BYTES:
                self.dropped += 1
                continue
            self.pending.append(line)
            self.pending_bytes += len(line)

    def write(self) -> None:
        """Writes the pending lines in order, as far as the disk lets it (one write a batch)."""
        while self.pending:
            data = b"".join(self.pending)
            try:
                written = os.write(self.fd, data)
            except OSError:  # ENOSPC, EDQUOT, EIO: kept, and tried again later
                return
            self._consume(written)

    def _consume(self, written: int) -> None:
        self.pending_bytes -= written
        while written:
            line = self.pending.popleft()
            if written < len(line):
                self.pending.appendleft(line[written:])  # the rest of a line written in part
                return
            written -= len(line)

    def close(self) -> None:
        os.close(self.fd)
