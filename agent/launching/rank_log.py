"""A rank's output in a file of its own, bounded: `rank-R.log` is rotated at `max_bytes` into
`rank-R.log.1` (the older part, replaced at each rotation), so a rank keeps at most twice that on
its node, however much it prints. The rank runner copies the rank's stdout and stderr there from a
pipe (agent.launching.rank_runner), the values of the job's `env` blanked on the way, even a secret
the rank printed in two writes (ett/protocol/redaction.py): what reaches the file, and so what the
agent ships to the service (agent/forwarding/log_shipper.py), holds none.
Imported by the rank runner at every launch: a few modules of the standard library and ett.protocol only."""

import contextlib
import os
import select
import threading
from collections.abc import Iterable

from ett.protocol.redaction import Redactor

DEFAULT_MAX_BYTES = 16 << 20
CHUNK_BYTES = 1 << 16
# How long a rank runner waits, once its rank has exited, for what the rank wrote to be in its log
# (milliseconds, unless the node is starved); the agent reports the rank's failure once it is.
OUTPUT_DRAIN_SECONDS = 1.0
# How long it then copies what a child of the rank, still holding the pipe, writes.
CHILDREN_OUTPUT_SECONDS = 2.0
# The rank runner's record that its rank's output is all in its log
# (agent.launching.rank_runner -> agent.groups.rank_records).
OUTPUT_IN_LOG = "output_in_log"


def last_line(path: str, max_bytes: int = 4096, max_chars: int = 300) -> str:
    """The last non-empty line of a log (torchrun's: why it ended before any rank started, e.g. its
    rendezvous port in use), from its last `max_bytes`, cut at `max_chars`; "" when none or unreadable.
    The file is the agent's own (root's folder); its contents are the job's: bounded, never followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        f.seek(max(0, os.fstat(fd).st_size - max_bytes))
        lines = [line.strip() for line in f.read(max_bytes).decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:max_chars] if lines else ""


class RotatingLog:
    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path, self.max_bytes = path, max_bytes
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def write(self, data: bytes) -> None:
        if self._size and self._size + len(data) > self.max_bytes:
            os.replace(self.path, self.path + ".1")
            fresh = self._open()  # first: a full disk leaves the old descriptor in place, still ours to close
            os.close(self._fd)
            self._fd, self._size = fresh, 0
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._size += len(data)

    def close(self) -> None:
        os.close(self._fd)


class PipeCopier:
    """Copies a pipe into the log, on a thread of its own, until every writer has closed it (the
    rank and its children), `secrets` blanked. `caught_up` tells when what is in the pipe now is in
    the log: a child of the rank may hold the pipe long after the rank's exit, but the rank's own
    last words are there (what was kept back as the possible start of a secret included)."""

    def __init__(self, read_fd: int, log: RotatingLog, secrets: Iterable[str] = ()) -> None:
        self._read_fd, self._log = read_fd, log
        self._redactor = Redactor(secrets)
        self._wake_read, wake_write = os.pipe()
        self._wake_write: int | None = wake_write
        self._caught_up = threading.Event()
        self._thread = threading.Thread(target=self._copy, name="rank-log", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        poller = select.poll()
        poller.register(self._read_fd, select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        asked = False
        try:
            while True:
                ready = dict(poller.poll(0 if asked and not self._caught_up.is_set() else None))
                if self._wake_read in ready:
                    poller.unregister(self._wake_read)  # asked once, for good
                    asked = True
                if self._read_fd in ready:
                    chunk = os.read(self._read_fd, CHUNK_BYTES)
                    if not chunk:
                        break  # every writer is gone
                    self._write(self._redactor.feed(chunk))
                elif asked and not self._caught_up.is_set():
                    self._write(self._redactor.flush())  # the rank has ended: its last words, whole
                    self._caught_up.set()  # the pipe read empty after the question: all it held is copied
        finally:
            self._write(self._redactor.flush())
            self._caught_up.set()
            for fd in (self._read_fd, self._wake_read):
                os.close(fd)
            self._log.close()

    def _write(self, data: bytes) -> None:
        if data:
            with contextlib.suppress(OSError):  # a full disk: the rank's output is lost, not the rank
                self._log.write(data)  # (a pipe nobody reads would stop it, a closed one end it)

    def caught_up(self, timeout: float) -> bool:
        """Once the rank has exited: whether what it wrote is all in the log, within `timeout`."""
        self._close_wake()  # the copier's poll sees the pipe's end: the question
        return self._caught_up.wait(timeout)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        self._close_wake()

    def _close_wake(self) -> None:
        if self._wake_write is not None:
            os.close(self._wake_write)
            self._wake_write = None
