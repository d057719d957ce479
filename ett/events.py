"""Schema-v1 events (docs/events.md) appended as JSONL to this rank's spool file, which the agent tails.

`emit` only stamps the event and puts it on a queue (a few microseconds); a background thread
serialises, writes and flushes each line, so the agent sees it within milliseconds and a slow
disk never stalls a training step.

Only rank 0 sends `step` events, so every rank also keeps a progress mark: its last finished
step and a count of liveness beats (work outside steps, `Run.progress`), `"<step> <beats>"`
overwritten in place in `progress-rank-{RANK}` beside the spool. It is not an event and is not
forwarded; the agent of each node reads it to detect hangs (any change is progress) and to time
faults of its own ranks (by the step).
"""

import json
import os
import queue
import threading
import time
from pathlib import Path

_CLOSE = object()
# The kinds a rank writes (docs/events.md); the agents and the service write the others.
RANK_KINDS = frozenset({"init_start", "init_end", "restore_start", "restore_end", "step", "ckpt_start", "ckpt_staged",
                        "ckpt_committed", "ckpt_failed", "train_end"})
PROGRESS_WIDTH = 40  # fixed, so an overwrite never leaves digits of a longer mark behind


def make_event(kind: str, ts: float, attempt: int, source: str, seq: int, step: int | None = None,
               data: dict | None = None) -> dict:
    """One schema-v1 event (docs/events.md) as written to a spool or ingested: the one place its
    fields are named, for the ranks, the agents and the service."""
    return {"kind": kind, "ts": ts, "attempt": attempt, "source": source, "seq": seq, "step": step,
            "data": data if data is not None else {}}


class EventWriter:
    def __init__(self, spool_dir: str | None, rank: int, attempt: int):
        self.source = f"rank:{rank}"
        self.attempt = attempt
        self.path = Path(spool_dir) / f"rank-{rank}.jsonl" if spool_dir else None
        self.progress_path = Path(spool_dir) / f"progress-rank-{rank}" if spool_dir else None
        self._lock = threading.Lock()  # seq order must equal file order across emitting threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._mark = (0, 0)  # (last step, beats): the progress mark
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._seq = self._next_seq_in(self.path)
            self._thread = threading.Thread(target=self._write_loop, name="ett-events", daemon=True)
            self._thread.start()

    @classmethod
    def from_env(cls, rank: int) -> "EventWriter":
        return cls(os.environ.get("ETT_EVENT_DIR"), rank, int(os.environ.get("ETT_ATTEMPT", "0")))

    def emit(self, kind: str, step: int | None = None, **data) -> None:
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
                last_step, beats = self._mark
                self._mark = (last_step, beats + 1) if step is None else (step, beats)
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

    def _write_loop(self) -> None:
        with open(self.path, "ab") as spool, open(self.progress_path, "wb", buffering=0) as progress:
            if spool.tell() > 0:
                # A kill may have left a partial last line: start ours on a fresh line.
                with open(self.path, "rb") as existing:
                    existing.seek(-1, os.SEEK_END)
                    if existing.read(1) != b"\n":
                        spool.write(b"\n")
            while True:
                event = self._queue.get()
                if event is _CLOSE:
                    break
                lines = [event]
                while True:  # write whatever else is already queued with one flush
                    try:
                        lines.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                closing = _CLOSE in lines
                marks = [e for e in lines if isinstance(e, tuple)]
                if marks:
                    os.pwrite(progress.fileno(), "{} {}".format(*marks[-1]).rjust(PROGRESS_WIDTH).encode(), 0)
                events = [e for e in lines if isinstance(e, dict)]
                spool.write(b"".join(json.dumps(e).encode() + b"\n" for e in events))
                spool.flush()
                if closing:
                    break
