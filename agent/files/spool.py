"""The on-disk layout of an attempt on this node, and reading/appending JSONL files safely.

    DATA_DIR/spool/JOB_ID/ATTEMPT/     the agent's (root, 0711): the job passes, cannot write
        events/                 the job's (its user, 0700)
            rank-R.jsonl        written by the ranks (ETT_EVENT_DIR), forwarded to the service
            progress-rank-R     each rank's progress mark, read by the monitor loop
        logs/                   the job's (its user, 0700): rank-R.log, each rank's output (agent.launching.rank_log)
        control/                the job's (its user, 0700)
            ranks.jsonl         rank runner records: start (pids) and end (exit code or signal)
            checkpoint-interval new checkpoint intervals; rank-R.exit, an injected exit's code
        node-NAME.jsonl         the agent's own events for this attempt, forwarded the same way
        launch.json             the launch command (the job's checkpoint folder, for the forwarder)
        torchrun.log            torchrun's and the rank runners' stdout and stderr (0600)
        ended                   written when the group is over: the spool may go once forwarded

What the agent reads in the job's two folders it opens without following a link, as regular files
of one link only (a hard link to a root-only file is not read), bounded; it writes nothing there
but through agent.files.beneath.

Once an ended attempt is all forwarded, its events/ folder is deleted and the rest of the folder
moves to DATA_DIR/finished/JOB_ID/ATTEMPT/ (agent.forwarding.forward).
"""

import ctypes
import errno
import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.files.jsonl import append_json_line
from ett.events import make_event
from ett.protocol import (
    CONTROL_DIR,
    ENDED_MARKER,
    EVENTS_DIR,
    INTERVAL_FILE,
    LOG_FILE,
    LOGS_DIR,
    RANKS_FILE,
    node_spool,
)

LAUNCH_FILE = "launch.json"


@dataclass(frozen=True)
class AttemptPaths:
    root: Path

    @classmethod
    def of(cls, spool_root: Path, job_id: str, attempt: int) -> "AttemptPaths":
        return cls(spool_root / job_id / str(attempt))

    @property
    def events_dir(self) -> Path:
        return self.root / EVENTS_DIR

    @property
    def ranks_file(self) -> Path:
        return self.control_dir / RANKS_FILE

    @property
    def control_dir(self) -> Path:
        return self.root / CONTROL_DIR

    @property
    def logs_dir(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def interval_file(self) -> Path:
        """New checkpoint intervals for the ranks: a "<interval_steps> <from_step>" line per change (ETT_CHECKPOINT_INTERVAL_FILE)."""
        return self.control_dir / INTERVAL_FILE

    @property
    def log_file(self) -> Path:
        return self.root / LOG_FILE

    @property
    def ended_marker(self) -> Path:
        return self.root / ENDED_MARKER

    @property
    def launch_file(self) -> Path:
        return self.root / LAUNCH_FILE

    def node_spool(self, node: str) -> Path:
        return self.root / node_spool(node)


# No event comes near this; a job's spool may hold anything, so a longer line is cut into pieces
# of this size (each read as a line that is not an event) rather than read without a bound.
MAX_LINE_BYTES = 4 << 20


def read_complete_lines(path: Path, offset: int, max_bytes: int = 1 << 20) -> tuple[list[tuple[bytes, int]], int]:
    """Lines after `offset` that end in a newline, each with the offset just past it.

    A line still being written (no newline yet) is left for the next call; one past
    MAX_LINE_BYTES is no event: its start is returned as a line that ends where the file ends now,
    the rest skipped unread (a job's sparse terabyte would otherwise be read for days). The file is
    not followed if it is a link (a job's folders are the job's to fill; the agent runs as root).
    OSError (a folder, a link) is the caller's to keep to that file.
    """
    try:
        fd = open_job_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return [], offset
    with open(fd, "rb") as f:
        f.seek(offset)
        chunk = f.read(max_bytes)
        size = os.fstat(f.fileno()).st_size
    if len(chunk) == max_bytes and b"\n" not in chunk:
        if max_bytes < MAX_LINE_BYTES:  # one line longer than the chunk
            return read_complete_lines(path, offset, min(4 * max_bytes, MAX_LINE_BYTES))
        end = max(size, offset + max_bytes)
        return [(chunk, end)], end  # cut: not an event, set aside
    lines = []
    position = offset
    start = 0
    while (end := chunk.find(b"\n", start)) != -1:
        position = offset + end + 1
        lines.append((chunk[start:end], position))
        start = end + 1
    return lines, position


def open_job_file(path: Path, flags: int) -> int:
    """A descriptor of `path`, a regular file with one link, opened without following a link or
    blocking (a FIFO); OSError otherwise. A hard link the job made to a file it cannot read would
    have two."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise OSError(errno.EPERM, "not a regular file of one link", str(path))
    return fd


def write_private(path: Path, data: bytes) -> None:
    """A file of the agent's own, in a folder of its own: readable by it alone."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as f:
        f.write(data)


def save_private_json(path: Path, value: Any) -> None:
    """The agent's own state (read positions): written whole and durable, then renamed over the
    old (a crash leaves one or the other), readable by the agent alone (it names every job)."""
    temporary = path.with_suffix(".tmp")
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def release_prefix(path: Path, end: int) -> bool:
    """Frees the disk blocks of the file's first `end` bytes, keeping its size and offsets.

    The bytes read back as zeros afterwards, so only a prefix nobody will read again may go.
    False when the file system cannot punch holes (the file then keeps its blocks).
    """
    fd = open_job_file(path, os.O_WRONLY)
    try:
        flags = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        return _libc.fallocate(fd, flags, ctypes.c_long(0), ctypes.c_long(end)) == 0
    finally:
        os.close(fd)


def disk_bytes(path: Path) -> int:
    """Bytes the file really occupies (holes not counted)."""
    return path.lstat().st_blocks * 512


class SpoolReader:
    """Follows the JSONL files of one folder (or one file) from where it last stopped, in memory."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}

    def read(self, path: Path) -> list[dict[str, Any]]:
        try:
            lines, self.offsets[path] = read_complete_lines(path, self.offsets.get(path, 0))
        except OSError:  # a folder or a link where a spool should be: that file's trouble alone
            return []
        # The forwarder sets bad lines aside; the monitor only needs good ones.
        return [record for raw, _ in lines if (record := parse_event(raw)) is not None]


class NodeEventLog:
    """The agent's schema-v1 events about one attempt, with seq carried on across agent restarts."""

    def __init__(self, path: Path, node_name: str, attempt: int) -> None:
        self.path = path
        self.source = f"node:{node_name}"
        self.attempt = attempt
        self.seq = self._last_seq() + 1

    def _last_seq(self) -> int:
        lines, _ = read_complete_lines(self.path, 0)
        return max((event.get("seq", -1) for event in map(parse_event, (raw for raw, _ in lines)) if event),
                   default=-1)

    def emit(self, kind: str, data: dict[str, Any], step: int | None = None) -> None:
        event = make_event(kind, time.time(), self.attempt, self.source, self.seq, step, data)
        append_json_line(self.path, event, mode=0o600)  # the agent's: no job reads another's
        self.seq += 1


# What a JSON escape of half a UTF-16 pair looks like (D800 to DFFF); a pair is one character once parsed.
LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]", re.ASCII)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: no JSON the service can be sent
        raise ValueError(f"{text} is not a finite number")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def parse_event(raw: bytes) -> dict[str, Any] | None:
    """The event on a spool line, or None when the line is not a JSON object (or was released).
    A job's line may nest deeper than the parser recurses, or hold NaN or a number past a float's
    range, or half of a UTF-16 pair (`"\\ud800"`), which Python reads and no encoder of UTF-8 JSON writes:
    a NaN, then half a pair, stopped forwarding for every job of the node (found by reviews): no event either."""
    try:
        event = json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
        if LONE_SURROGATE_ESCAPE.search(raw):  # rare: only then is the parsed event encoded to look
            json.dumps(event, ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return event if isinstance(event, dict) else None
