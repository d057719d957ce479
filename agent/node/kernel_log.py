"""Node evidence from the kernel's log: what the agent itself reads in /dev/kmsg, never what a job
says (docs/reliability.md, "Draining a node").

Only records the kernel wrote count. Each /dev/kmsg record starts `PRIORITY,SEQUENCE,MICROSECONDS,..;`
and the kernel gives a line written into /dev/kmsg from user space (which needs root) a facility
other than its own (LOG_USER when none is given): so no job, not even one run as root, can lay a
record here that reads as the kernel's. Of the kernel's records, three kinds tell of the node:

- `xid`: an NVIDIA Xid of the hardware or its driver (NODE_XIDS: a GPU fallen off the bus, ECC
  double-bit and uncorrectable errors, row remapping, NVLink, GSP). Xids a program causes itself
  (13 and 31: its own illegal access or MMU fault, 43: a channel it ended) are left out.
- `ecc`: EDAC's uncorrected memory errors (`EDAC MC0: 1 UE ...`); corrected ones (`CE`) are not.
- `oom_kill`: the out-of-memory killer ended a process over no limit of a job's own: the kernel's
  `oom-kill:` record says `global_oom` (the node ran out) or names the memory cgroup whose limit
  was hit (`oom_memcg=`), and that cgroup is not one a job may set a limit on (JOBS_CGROUPS: the
  agent's per-owner tree, a user's delegated systemd tree). A job over its own limit is the job's.

Read without blocking, a record at a time, bounded (RECORD_BYTES a record, KEPT readings held).
"""

import errno
import io
import os
import re
from collections import deque

from ett.protocol.messages import KERNEL_READING_CHARS, KERNEL_READINGS_PER_REPORT, KernelReading

RECORD_BYTES = 8192  # a kmsg record is at most this long
KEPT = 256  # readings held for the attempts that ran meanwhile; the oldest go first
KERNEL_FACILITY = 0
# NVIDIA's Xid catalogue: the hardware's or its driver's, not a program's.
NODE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
XID = re.compile(r"NVRM: Xid \([^)]{0,64}\): (\d{1,4})\b")
ECC_UNCORRECTED = re.compile(r"EDAC MC\d{1,4}: \d{1,9} UE\b")
# Memory cgroups a job may put a limit on: beneath the agent's owner-UID (agent/confinement/cgroups.py),
# or in a user's systemd tree, which its user may divide as it likes.
JOBS_CGROUPS = re.compile(r"/ett-[^/]+/owner-\d+(?:/|$)|/user@\d+\.service(?:/|$)")


def reading_of(record: bytes) -> KernelReading | None:
    """The node evidence one /dev/kmsg record holds, if any."""
    head, sep, body = record.partition(b";")
    fields = head.split(b",")
    if not sep or len(fields) < 3 or not all(f.isdigit() for f in fields[:3]):
        return None
    if int(fields[0]) >> 3 != KERNEL_FACILITY:
        return None  # written from user space: not the kernel's word
    message = body.split(b"\n", 1)[0].decode(errors="replace")  # without the record's KEY=value lines
    kind = _kind(message)
    if kind is None:
        return None
    key = f"kmsg:{int(fields[1])}:{int(fields[2])}"
    return KernelReading(kind=kind, key=key, text=message[:KERNEL_READING_CHARS])


def _kind(message: str) -> str | None:
    if (xid := XID.search(message)) is not None:
        return "xid" if int(xid.group(1)) in NODE_XIDS else None
    if ECC_UNCORRECTED.search(message):
        return "ecc"
    if message.startswith("oom-kill:"):
        parts = message.removeprefix("oom-kill:").split(",")
        limit = next((p.removeprefix("oom_memcg=") for p in parts if p.startswith("oom_memcg=")), None)
        if "global_oom" in parts or "constraint=CONSTRAINT_NONE" in parts:
            return "oom_kill"  # the node's memory, not a limit's
        if limit is not None and JOBS_CGROUPS.search(limit) is None:
            return "oom_kill"  # a limit the operator set (the agent's, a slice's), not the job's
    return None


class KernelLog:
    """The kernel's node evidence from the log's end at its making on, numbered as read (an attempt
    notes the number at its start: mark). Not thread-safe: its owner holds a lock."""

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self._file: io.FileIO | None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            self._file = None  # an agent that may not read the kernel's log finds nothing
        else:
            self._file = io.FileIO(fd, "rb", closefd=True)  # closed with the object
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError:
                self.close()
        self._read = 0  # readings found so far
        self._kept: deque[tuple[int, KernelReading]] = deque(maxlen=KEPT)

    def mark(self) -> int:
        """The number the next reading will have."""
        self.poll()
        return self._read

    def since(self, mark: int) -> list[KernelReading]:
        """The readings from `mark` on, the first KERNEL_READINGS_PER_REPORT of them."""
        self.poll()
        return [reading for number, reading in self._kept if number >= mark][:KERNEL_READINGS_PER_REPORT]

    def poll(self) -> None:
        """Reads the records written since, so that none is overwritten before it is read."""
        while self._file is not None:
            try:
                record = self._file.read(RECORD_BYTES)
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records overwritten while reading: go on from the next
                return
            if not record:  # None: the end of the buffer (EAGAIN)
                return
            reading = reading_of(record)
            if reading is not None:
                self._kept.append((self._read, reading))
                self._read += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
