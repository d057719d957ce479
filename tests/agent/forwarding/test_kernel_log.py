"""Node evidence from the kernel's log as the agent reads it (agent/node/kernel_log.py): the kernel's
own records of the node's hardware and memory count, a line written into the log from user space
(even by root) never does, nor an Xid a program causes itself or an out-of-memory kill under a
limit a job may set. The last two tests use the real /dev/kmsg: a line written into it as root,
and a real kill by the kernel's out-of-memory killer in a memory cgroup of the operator's."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.node.kernel_log import KernelLog, reading_of
from tests.support.waiting import wait_for

XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."


def kernel(message: str, seq: int = 7, priority: int = 4) -> bytes:
    """A record as /dev/kmsg hands it out: `PRIORITY,SEQUENCE,MICROSECONDS,FLAGS;TEXT`, then the
    record's KEY=value lines. Facility 0 (the priority's upper bits): the kernel's."""
    return f"{priority},{seq},123456,-;{message}\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n".encode()


def oom_kill(limit: str) -> str:
    return (f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg={limit},"
            f"task_memcg={limit},task=python3,pid=4242,uid=1001")


def test_the_kernels_records_of_the_node_are_evidence_and_nothing_else_is():
    xid = reading_of(kernel(XID_79, seq=41))
    assert xid is not None and (xid.kind, xid.key, xid.text) == ("xid", "kmsg:41:123456", XID_79)
    ecc = reading_of(kernel("EDAC MC0: 1 UE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0"))
    assert ecc is not None and ecc.kind == "ecc"
    node_out_of_memory = ("oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,"
                          "task_memcg=/system.slice/x.service,task=python3,pid=9691,uid=0")
    for message in (node_out_of_memory, oom_kill("/ett-test-4242"), oom_kill("/system.slice/ett-agent.service")):
        found = reading_of(kernel(message))
        assert found is not None and found.kind == "oom_kill", message

    not_the_nodes = [
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, Graphics Exception",  # a program's own illegal access
        "NVRM: Xid (PCI:0000:3b:00): 31, pid=1234, MMU Fault",
        "EDAC MC0: 1 CE memory read error",  # corrected
        oom_kill("/system.slice/ett-agent.service/ett-node-a-1a2b3c4d/owner-1001/j1.0.abcdef012345"),  # the job's
        oom_kill("/system.slice/ett-agent.service/ett-node-a-1a2b3c4d/owner-1001"),
        oom_kill("/user.slice/user-1001.slice/user@1001.service/app.slice/hog.scope"),  # a user's own tree
        "Memory cgroup out of memory: Killed process 4242 (python3)",  # which limit: the oom-kill record says
        "python3 printed Xid 79 and No space left on device",
    ]
    assert [reading_of(kernel(message)) for message in not_the_nodes] == [None] * len(not_the_nodes)
    user_space = 1 << 3 | 4  # LOG_USER: what the kernel makes of any line written into /dev/kmsg
    assert reading_of(kernel(XID_79, priority=user_space)) is None
    assert [reading_of(b"garbage"), reading_of(b"4,x,1,-;" + XID_79.encode()), reading_of(b"")] == [None] * 3
    long = reading_of(kernel(XID_79 + " " + "x" * 10_000))
    assert long is not None and len(long.text) == 240


@pytest.mark.skipif(not os.access("/dev/kmsg", os.W_OK), reason="writing the kernel log needs root")
def test_a_line_written_into_the_kernel_log_even_by_root_is_not_the_kernels_word():
    log = KernelLog()
    try:
        mark = log.mark()
        with open("/dev/kmsg", "w") as kmsg:
            for line in (XID_79, f"<0>{XID_79}", f"<3>{oom_kill('/ett-test-1')}"):  # claims of the kernel's priority
                kmsg.write(line + "\n")
                kmsg.flush()
        assert log.since(mark) == []
    finally:
        log.close()


MEMORY_V1 = Path("/sys/fs/cgroup/memory")
HOG = "h = []\nwhile True:\n    h.append(bytearray(8 << 20)); h[-1][::4096] = b'x' * (2 << 10)"


@pytest.mark.skipif(os.geteuid() != 0 or not MEMORY_V1.is_dir(), reason="a v1 memory cgroup of the operator's")
def test_a_real_kill_by_the_kernel_under_the_operators_limit_is_read_as_node_evidence():
    cap = MEMORY_V1 / f"ett-kernel-log-test-{os.getpid()}"
    cap.mkdir()
    log = KernelLog()
    try:
        (cap / "memory.limit_in_bytes").write_text(str(64 << 20))
        mark = log.mark()
        hog = subprocess.Popen([sys.executable, "-c", HOG],  # placed in the cap before it allocates
                               preexec_fn=lambda: (cap / "cgroup.procs").write_text(str(os.getpid())))
        assert hog.wait(timeout=60) == -9
        wait_for(lambda: any(r.kind == "oom_kill" and f"pid={hog.pid}," in r.text for r in log.since(mark)), 10,
                 "the kernel's record of the kill")
    finally:
        log.close()
        for _ in range(50):
            with contextlib.suppress(OSError):
                cap.rmdir()
                break
