"""Forwards the attempts' JSONL spools to the service: batched, idempotent, never lost.

- The spool files are the on-disk buffer: a line counts as sent only once the service accepted
  it, and only then does its file's read position move on (persisted atomically), so an agent
  restart resends at most one batch, which the service drops by its idempotency key.
- While the service is down or failing, the same batch is retried with exponential backoff and
  jitter; the ranks keep appending meanwhile.
- A batch refused with 422 is not retried as it is: the events the answer names
  (`events.<index>...`) go to a dead-letter file and the rest is sent again. An answer naming
  none is bisected until the bad events stand alone.
- Disk use is bounded by what is not yet forwarded: the forwarded start of a live spool gives
  its blocks back (a hole is punched; offsets stay valid), and the spool of an ended attempt is
  deleted once all of it is forwarded (its logs move to DATA_DIR/finished, so the spool folder
  only ever holds live or unforwarded attempts and scanning it stays cheap). The disk the
  spools use is counted, and a warning is logged while it is above its bound (events are never
  dropped to get under it).
"""

import contextlib
import json
import logging
import os
import random
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from agent.files.jsonl import append_json_line
from agent.files.spool import AttemptPaths, disk_bytes, read_complete_lines, release_prefix, save_private_json
from agent.forwarding.log_shipper import LogShipper
from agent.forwarding.stamp import RANK_SPOOL_NAME, Stamper
from agent.node.metrics import AgentStats
from ett.protocol import EVENTS_DIR, NODE_SPOOL_GLOB, RANK_SPOOL_GLOB

log = logging.getLogger(__name__)
REJECTED_INDEX = re.compile(r"\bevents\.(\d+)\b")
# The forwarded start of a live spool is released in these steps, this far behind the read
# position, so the monitor loop (which reads the same files on its own) never meets a hole.
RELEASE_CHUNK_BYTES = 1 << 20
RELEASE_MARGIN_BYTES = 1 << 20
Send = Callable[[list[dict[str, Any]]], httpx.Response]


@dataclass
class Spooled:
    """One line of a spool file, on its way to the service."""

    file: str  # relative to the spool root: JOB_ID/ATTEMPT/events/rank-R.jsonl or JOB_ID/ATTEMPT/node-NAME.jsonl
    end: int  # the file offset just past the line
    raw: bytes
    event: dict[str, Any] | None  # None: the line is not a JSON object
    read_at: float
    done: bool = False


@dataclass(frozen=True)
class ForwardConfig:
    batch_max_events: int = 500
    batch_max_age_seconds: float = 0.5
    retry_base_seconds: float = 0.5
    retry_max_seconds: float = 30.0
    spool_max_bytes: int = 1 << 30


def rejected_indices(body: Any) -> set[int]:
    """Event indices a 422 answer names, from FastAPI's `loc` lists or `events.N.field` text."""
    detail = body.get("detail") if isinstance(body, dict) else body
    found = {int(n) for n in REJECTED_INDEX.findall(json.dumps(detail))}
    for error in detail if isinstance(detail, list) else []:
        loc = error.get("loc", []) if isinstance(error, dict) else []
        found |= {b for a, b in zip(loc, loc[1:]) if a == "events" and isinstance(b, int)}
    return found


DEAD_LETTER_LINE_BYTES = 4096  # what a dead letter keeps of the line it sets aside


def _is_plain(path: Path, kind: Any) -> bool:
    """`path` itself (not a link) is of this kind (stat.S_ISDIR, stat.S_ISREG)."""
    try:
        return kind(os.lstat(path).st_mode)
    except OSError:
        return False


class Forwarder:
    def __init__(self, spool_root: Path, state_dir: Path, send: Send, stats: AgentStats,
                 config: ForwardConfig = ForwardConfig(), logs: LogShipper | None = None) -> None:
        self.spool_root = spool_root
        self.send = send
        self.stats = stats
        self.config = config
        self.offsets_file = state_dir / "forward-offsets.json"
        self.dead_letter_file = state_dir / "dead-letters.jsonl"
        self.finished_root = state_dir / "finished"
        self.acked: dict[str, int] = json.loads(self.offsets_file.read_text()) if self.offsets_file.exists() else {}
        self.read_to: dict[str, int] = dict(self.acked)
        self.released: dict[str, int] = {}
        self.pending: list[Spooled] = []
        self.failures = 0
        self.stamper = Stamper(spool_root)
        self.logs = logs  # the ranks' output, shipped beside their events (agent/forwarding/log_shipper.py)
        self._flush_waiters: list[threading.Event] = []  # list.append and swap: safe across threads
        self._wake = threading.Event()
        if self.dead_letter_file.exists():
            self.stats.dead_letters = len(self.dead_letter_file.read_bytes().splitlines())

    def run(self, stop: threading.Event, poll_seconds: float = 0.1) -> None:
        """The forwarding thread: until `stop`, then one last try to send what is read."""
        while not stop.is_set():
            waiters, self._flush_waiters = self._flush_waiters, []
            try:
                forwarded = self.forward_once(flush=bool(waiters))
            except Exception:  # a bug or a full disk must not end forwarding for good
                log.exception("forwarding failed")
                self.failures += 1
                forwarded = False
            for done in waiters if forwarded else ():
                done.set()
            if not forwarded:
                # Cut short by a flush (an attempt's end waits for its events, agent.groups.supervisor's
                # ReportBook) and by wake() at the end.
                self._wake.wait(self._backoff())
                self._wake.clear()
            elif not self._flush_waiters:
                self._wake.wait(poll_seconds)
                self._wake.clear()
        self.forward_once(flush=True)

    def flush(self, timeout: float) -> bool:
        """Asks the forwarding thread to send everything written so far, without waiting for a
        batch to fill; True once it has, False after `timeout` (the service may be down)."""
        done = threading.Event()
        self._flush_waiters.append(done)
        self.wake()
        return done.wait(timeout)

    def wake(self) -> None:
        """Ends a wait (a backoff, the poll period) at once."""
        self._wake.set()

    def forward_once(self, flush: bool) -> bool:
        """Reads new lines and sends batches while one is due, and the ranks' new output; False
        when the service failed us."""
        if self.logs is not None and not self.logs.ship_once():
            self.failures += 1
            return False
        self._tidy_spools()
        while self._read_spools() or self.pending:
            if not (flush or self._batch_due()):
                break
            batch = self.pending[: self.config.batch_max_events]
            if not self._deliver([item for item in batch if not item.done]):
                self.failures += 1
                self.stats.forward_failures += 1
                return False
            self.failures = 0
            self._commit(batch)
        return True

    def _batch_due(self) -> bool:
        return (len(self.pending) >= self.config.batch_max_events
                or time.monotonic() - self.pending[0].read_at >= self.config.batch_max_age_seconds)

    def _backoff(self) -> float:
        limit = min(self.config.retry_max_seconds, self.config.retry_base_seconds * 2 ** (self.failures - 1))
        return limit / 2 + random.uniform(0, limit / 2)  # jitter: agents do not retry in step

    def _spool_files(self) -> list[Path]:
        """The spools: the agent's own, and the ranks' regular files in an attempt's own events
        folder. What a job lays there instead (a folder, a link, its events folder a link) is not
        read: we are root."""
        ranks = [path for path in self.spool_root.glob(f"*/*/{EVENTS_DIR}/{RANK_SPOOL_GLOB}")
                 if RANK_SPOOL_NAME.match(path.name) and _is_plain(path.parent, stat.S_ISDIR)
                 and _is_plain(path, stat.S_ISREG)]
        return sorted([*ranks, *self.spool_root.glob(f"*/*/{NODE_SPOOL_GLOB}")])

    def _read_spools(self) -> bool:
        """Reads on into `pending` (up to a few batches); True when there was something new."""
        room = 4 * self.config.batch_max_events - len(self.pending)
        before = len(self.pending)
        now = time.monotonic()
        for path in self._spool_files():
            if room <= 0:
                break
            name = str(path.relative_to(self.spool_root))
            try:
                lines, self.read_to[name] = read_complete_lines(path, self.read_to.get(name, 0), max_bytes=256 * 1024)
            except OSError as exc:  # this file's trouble (swapped for a link since listed): not the others'
                log.warning("spool %s not read: %s", name, exc)
                continue
            for raw, end in lines[:room]:
                self.pending.append(Spooled(name, end, raw, self.stamper.stamped(name, raw), now))
            if len(lines) > room:
                self.read_to[name] = lines[room - 1][1]
            room -= len(lines)
        self.stats.events_buffered = len(self.pending)
        return len(self.pending) > before

    def _deliver(self, items: list[Spooled]) -> bool:
        """Sends items (marking each done); False when the service is unreachable or failing."""
        for item in items:
            if item.event is None:
                self._dead_letter(item, "not a JSON object")
        items = [item for item in items if not item.done]
        if not items:
            return True
        events = [item.event | {"job_id": item.file.split("/", 1)[0]} for item in items]
        try:
            response = self.send(events)
        except httpx.HTTPError as exc:
            log.warning("forwarding %d events failed: %s", len(items), exc)
            return False
        if response.status_code == 200:
            for item in items:
                item.done = True
            self.stats.events_forwarded += len(items)
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                self.stats.events_repeated += int(response.json().get("duplicates", 0))
            return True
        if response.status_code not in (413, 422):
            log.warning("forwarding %d events: service answered %d %s", len(items), response.status_code,
                        response.text[:200])
            return False
        detail = response.text
        with contextlib.suppress(ValueError):
            detail = response.json()
        named = {i for i in rejected_indices(detail) if i < len(items)}
        for i in named:
            self._dead_letter(items[i], detail)
        rest = [item for item in items if not item.done]
        if named or not rest:
            return self._deliver(rest)
        if len(rest) == 1:
            self._dead_letter(rest[0], detail)
            return True
        half = len(rest) // 2
        return self._deliver(rest[:half]) and self._deliver(rest[half:])

    def _dead_letter(self, item: Spooled, error: Any) -> None:
        log.error("event set aside in %s: %s: %s", self.dead_letter_file, item.file, str(error)[:200])
        line = item.raw[:DEAD_LETTER_LINE_BYTES].decode(errors="replace")  # a job's line may be megabytes
        append_json_line(self.dead_letter_file, {"file": item.file, "end_offset": item.end, "line": line,
                                                 "bytes": len(item.raw), "error": error}, mode=0o600)
        item.done = True
        self.stats.dead_letters += 1

    def _commit(self, batch: list[Spooled]) -> None:
        for item in batch:
            self.acked[item.file] = item.end
        self.pending = self.pending[len(batch):]
        self.stats.events_buffered = len(self.pending)
        self._save_offsets()
        for name in {item.file for item in batch}:
            self._release(name)

    def _release(self, name: str) -> None:
        """Gives the disk of a spool's forwarded part back, in whole MiB, well behind any reader."""
        end = (self.acked[name] - RELEASE_MARGIN_BYTES) // RELEASE_CHUNK_BYTES * RELEASE_CHUNK_BYTES
        if end <= self.released.get(name, 0):
            return
        try:
            if release_prefix(self.spool_root / name, end):
                self.released[name] = end
        except OSError as exc:  # swapped by the job since it was read: kept, not written through
            log.warning("spool %s: forwarded part not released: %s", name, exc)

    def _save_offsets(self) -> None:
        save_private_json(self.offsets_file, self.acked)

    def _tidy_spools(self) -> None:
        """Deletes the spools of ended attempts once forwarded; counts the disk the rest use."""
        sizes: dict[Path, int] = {}
        forwarded: dict[Path, bool] = {}
        backlog = 0
        for path in self._spool_files():
            relative = path.relative_to(self.spool_root)
            acked = self.acked.get(str(relative), 0)
            attempt_dir = self.spool_root / relative.parts[0] / relative.parts[1]
            try:
                size, used = path.lstat().st_size, disk_bytes(path)
            except OSError:  # removed by its job since listed
                continue
            sizes[attempt_dir] = sizes.get(attempt_dir, 0) + used
            forwarded[attempt_dir] = forwarded.get(attempt_dir, True) and acked == size
            backlog += size - acked
        for attempt_dir, done in forwarded.items():
            shipped = self.logs is None or self.logs.shipped(attempt_dir)
            if done and shipped and AttemptPaths(attempt_dir).ended_marker.exists():
                self._retire(attempt_dir)
                del sizes[attempt_dir]
        total = sum(sizes.values())
        if total > self.config.spool_max_bytes >= self.stats.spool_bytes:
            log.warning("event spools use %d bytes, above their bound of %d", total, self.config.spool_max_bytes)
        self.stats.spool_bytes, self.stats.backlog_bytes = total, backlog

    def _retire(self, attempt_dir: Path) -> None:
        """An ended attempt, all forwarded: its events go, the rest (logs) moves out of the spool."""
        shutil.rmtree(AttemptPaths(attempt_dir).events_dir)
        finished = self.finished_root / attempt_dir.relative_to(self.spool_root)
        shutil.rmtree(finished, ignore_errors=True)
        finished.parent.mkdir(parents=True, exist_ok=True)
        os.replace(attempt_dir, finished)
        with contextlib.suppress(OSError):
            attempt_dir.parent.rmdir()  # the job's folder, once its last attempt is out
        self.stamper.forget(str(attempt_dir.relative_to(self.spool_root)))
        if self.logs is not None:
            self.logs.forget(str(attempt_dir.relative_to(self.spool_root)))
        prefix = f"{attempt_dir.relative_to(self.spool_root)}/"
        self.acked = {k: v for k, v in self.acked.items() if not k.startswith(prefix)}
        self.read_to = {k: v for k, v in self.read_to.items() if not k.startswith(prefix)}
        self.released = {k: v for k, v in self.released.items() if not k.startswith(prefix)}
        self._save_offsets()
