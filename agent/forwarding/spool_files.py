"""The event spools as the forwarder reads them (agent.forwarding.forward): which files, how far
each is read, how far the service has accepted each (kept on disk, so an agent restart resends at
most one batch), and how much of each has been given back to the disk (the forwarded start of a
live spool: a hole is punched, offsets stay valid). The spools of ranks beyond the attempt's world
(a name the job lays) are not read at all: the forwarder sets them aside with one note.
"""

import fnmatch
import json
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.files.log_limit import LogLimit
from agent.files.spool import read_complete_lines, release_prefix, save_private_json
from agent.forwarding.launches import Launches
from agent.forwarding.listing import Listings
from agent.forwarding.stamp import RANK_SPOOL_NAME
from ett.protocol import EVENTS_DIR, NODE_SPOOL_GLOB

log = logging.getLogger(__name__)
# The forwarded start of a live spool is released in these steps, this far behind the read
# position, so the monitor loop (which reads the same files on its own) never meets a hole.
RELEASE_CHUNK_BYTES = 1 << 20
RELEASE_MARGIN_BYTES = 1 << 20
# What a line keeps of its bytes once its event is made: enough for a dead letter to show it.
RAW_KEEP_BYTES = 4096
# The most the forwarder holds of lines read and not yet sent: a job's spools may hold any bytes
# (a sparse file of a terabyte reads as zeros), and what they hold costs the agent its memory.
PENDING_MAX_BYTES = 16 << 20


@dataclass
class Spooled:
    """One line of a spool file, on its way to the service."""

    file: str  # relative to the spool root: JOB_ID/ATTEMPT/events/rank-R.jsonl or JOB_ID/ATTEMPT/node-NAME.jsonl
    end: int  # the file offset just past the line
    raw: bytes  # its first RAW_KEEP_BYTES
    size: int  # its length in bytes
    event: dict[str, Any] | None  # None: the line is not a JSON object
    read_at: float
    done: bool = False

    @property
    def held(self) -> int:
        """About what it costs the agent's memory until it is sent: its event, or what it keeps of its line."""
        return self.size if self.event is not None else len(self.raw)


def _is_plain(path: Path, kind: Any) -> bool:
    """`path` itself (not a link) is of this kind (stat.S_ISDIR, stat.S_ISREG)."""
    try:
        return kind(os.lstat(path).st_mode)
    except OSError:
        return False


class SpoolFiles:
    def __init__(self, spool_root: Path, state_dir: Path, launches: Launches | None = None) -> None:
        self.spool_root = spool_root
        self.launches = launches or Launches(spool_root)  # each attempt's world
        self.listings = Listings()
        self.offsets_file = state_dir / "forward-offsets.json"
        self.acked: dict[str, int] = json.loads(self.offsets_file.read_text()) if self.offsets_file.exists() else {}
        self.read_to: dict[str, int] = dict(self.acked)
        self.released: dict[str, int] = {}
        self.beyond: dict[str, list[str]] = {}  # JOB_ID/ATTEMPT -> its spools of ranks beyond its world, at the last listing
        self._warnings = LogLimit(log)

    def by_attempt(self) -> dict[str, list[Path]]:
        """The spools, by attempt (JOB_ID/ATTEMPT): the agent's own, and the ranks' regular files in
        an attempt's own events folder, of ranks within its world. What a job lays there instead (a
        folder, a link, its events folder a link) is not read: we are root."""
        found: dict[str, list[Path]] = {}
        self.beyond = {}
        for job_id in self.listings.names(self.spool_root):
            for number in self.listings.names(self.spool_root / job_id):
                attempt, attempt_dir = f"{job_id}/{number}", self.spool_root / job_id / number
                paths = [attempt_dir / name for name in self.listings.names(attempt_dir)
                         if fnmatch.fnmatchcase(name, NODE_SPOOL_GLOB)]
                world = self.launches.of(attempt).world
                for name in self.listings.names(attempt_dir / EVENTS_DIR):
                    match = RANK_SPOOL_NAME.match(name)
                    if match is None:
                        continue
                    if world is not None and int(match.group(1)) >= world:
                        self.beyond.setdefault(attempt, []).append(name)
                    elif _is_plain(attempt_dir / EVENTS_DIR / name, stat.S_ISREG):
                        paths.append(attempt_dir / EVENTS_DIR / name)
                if paths:
                    found[attempt] = sorted(paths)
        return found

    def paths(self) -> list[Path]:
        """Every spool that is read (by_attempt's)."""
        return [path for paths in self.by_attempt().values() for path in paths]

    def read_on(self, paths: list[Path], room: int, byte_room: int,
                stamped: Callable[[str, bytes], dict[str, Any] | None], now: float) -> tuple[list[Spooled], bool]:
        """Up to `room` new lines of these files, read on from where each was left, each with its
        event as `stamped(name, raw)` makes it; once `byte_room` bytes are read no further file is
        read. Also whether every file was read to its last whole line."""
        new: list[Spooled] = []
        to_the_end = True
        for path in paths:
            if room <= 0 or byte_room <= 0:
                return new, False
            name = str(path.relative_to(self.spool_root))
            start = self.read_to.get(name, 0)
            try:
                lines, self.read_to[name] = read_complete_lines(path, start, max_bytes=256 * 1024)
            except OSError as exc:  # this file's trouble (swapped for a link since listed): not the others'
                self._warnings.warn(name, "spool %s not read: %s", name, exc)  # a lease on it: every pass
                continue
            for raw, end in lines[:room]:  # a line's size: the bytes of the file it covers (a cut one's skipped too)
                new.append(Spooled(name, end, raw[:RAW_KEEP_BYTES], end - start, stamped(name, raw), now))
                byte_room, start = byte_room - len(raw), end
            if len(lines) > room:
                self.read_to[name] = lines[room - 1][1]
            to_the_end = to_the_end and not lines  # lines read: there may be more after them
            room -= len(lines)
        return new, to_the_end

    def accept(self, batch: list[Spooled]) -> None:
        """The service has these lines: their files' accepted positions move on, on disk too, and
        the disk of what is now forwarded goes back."""
        for item in batch:
            self.acked[item.file] = item.end
        self._save()
        for name in {item.file for item in batch}:
            self._release(name)

    def forget(self, attempt: str) -> None:
        """An attempt's spool is gone (JOB_ID/ATTEMPT)."""
        prefix = f"{attempt}/"
        self.acked = {k: v for k, v in self.acked.items() if not k.startswith(prefix)}
        self.read_to = {k: v for k, v in self.read_to.items() if not k.startswith(prefix)}
        self.released = {k: v for k, v in self.released.items() if not k.startswith(prefix)}
        self.listings.forget(self.spool_root / attempt)
        self._save()

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

    def _save(self) -> None:
        save_private_json(self.offsets_file, self.acked)
