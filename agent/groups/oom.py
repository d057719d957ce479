"""Whether the kernel's out-of-memory killer ended a rank: the kernel log says `Killed process PID
(name)` (`Out of memory: ...` or `Memory cgroup out of memory: ...`). Read from /dev/kmsg, which an
agent started as root may read; elsewhere nothing is found and a SIGKILL stays a plain signal.

Only the records written since the attempt began count: the log keeps the killer's words about
processes long gone, and the kernel hands their numbers out again (a suite's rank once took the pid
of another test's process the killer had ended minutes before, and was said to be out of memory).
"""

import errno
import os
import re

KILLED = re.compile(rb"(?:Out of memory|out of memory): Killed process (\d+) \(([^)]*)\)")
RECORD_BYTES = 8192  # a kmsg record is at most this long


class OomWatch:
    """The out-of-memory killer's kills from the watch's making on (the kernel log from its end)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError:
            self._fd = None
        self._killed: dict[int, str] = {}

    def killed(self, pids: set[int]) -> dict[int, str]:
        """Of these pids, those the out-of-memory killer killed since, with the kernel's words."""
        self._read_new_records()
        return {pid: words for pid, words in self._killed.items() if pid in pids}

    def _read_new_records(self) -> None:
        while self._fd is not None:
            try:
                record = os.read(self._fd, RECORD_BYTES)
            except BlockingIOError:
                return  # the end of the buffer
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records overwritten while reading: go on from the next
                return
            if not record:
                return
            if match := KILLED.search(record):
                message = record.split(b";", 1)[-1].split(b"\n", 1)[0]
                self._killed[int(match.group(1))] = message.decode(errors="replace")[:200]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
