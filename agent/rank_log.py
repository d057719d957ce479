"""A rank's output in a file of its own, bounded: `rank-R.log` is rotated at `max_bytes` into
`rank-R.log.1` (the older part, replaced at each rotation), so a rank keeps at most twice that on
its node, however much it prints. The rank runner copies the rank's stdout and stderr there from a
pipe (agent.rank_runner); the agent ships what is new to the service (agent/log_shipper.py).
Imported by the rank runner at every launch: os and threading only."""

import os
import threading

DEFAULT_MAX_BYTES = 16 << 20
CHUNK_BYTES = 1 << 16
# How long a rank runner waits, once its rank has exited, for the rest of the rank's output (a child
# of the rank may still hold the pipe); the agent reports the rank's failure once its runner is gone.
OUTPUT_DRAIN_SECONDS = 2.0


class RotatingLog:
    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path, self.max_bytes = path, max_bytes
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def write(self, data: bytes) -> None:
        if self._size and self._size + len(data) > self.max_bytes:
            os.close(self._fd)
            os.replace(self.path, self.path + ".1")
            self._fd, self._size = self._open(), 0
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._size += len(data)

    def close(self) -> None:
        os.close(self._fd)


def copy_to_log(read_fd: int, log: RotatingLog) -> threading.Thread:
    """Copies the pipe into the log until every writer has closed it (the rank and its children)."""

    def copy() -> None:
        try:
            while chunk := os.read(read_fd, CHUNK_BYTES):
                log.write(chunk)
        except OSError:
            pass  # a full disk: the rank's output is lost, not the rank
        finally:
            os.close(read_fd)
            log.close()

    thread = threading.Thread(target=copy, name="rank-log", daemon=True)
    thread.start()
    return thread
