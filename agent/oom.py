"""Whether the kernel's out-of-memory killer ended a rank: the kernel log says `Killed process PID
(name)` (`Out of memory: ...` or `Memory cgroup out of memory: ...`). Read from /dev/kmsg, which an
agent started as root may read; elsewhere nothing is found and a SIGKILL stays a plain signal."""

import errno
import os
import re

KILLED = re.compile(rb"(?:Out of memory|out of memory): Killed process (\d+) \(([^)]*)\)")
RECORD_BYTES = 8192  # a kmsg record is at most this long


def oom_kills(pids: set[int]) -> dict[int, str]:
    """Of these pids, those the out-of-memory killer killed, with the kernel's words."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return {}
    found: dict[int, str] = {}
    try:
        while True:
            try:
                record = os.read(fd, RECORD_BYTES)
            except BlockingIOError:
                break  # the end of the buffer
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records overwritten while reading: go on from the next
                break
            if not record:
                break
            match = KILLED.search(record)
            if match and int(match.group(1)) in pids:
                message = record.split(b";", 1)[-1].split(b"\n", 1)[0]
                found[int(match.group(1))] = message.decode(errors="replace")[:200]
    finally:
        os.close(fd)
    return found
