"""The kernel's out-of-memory kills as the agent reads them (agent/groups/oom.py): only those logged since
the attempt began. The records are written into the real kernel log (/dev/kmsg, root only), for
pids above the kernel's highest (4194304), which no process can have."""

import os

import pytest

from agent.groups.oom import OomWatch


def log_kill(pid: int) -> None:
    with open("/dev/kmsg", "w") as kmsg:
        kmsg.write(f"Memory cgroup out of memory: Killed process {pid} (python3) total-vm:1kB\n")


@pytest.mark.skipif(not os.access("/dev/kmsg", os.W_OK), reason="writing the kernel log needs root")
def test_a_kill_logged_before_the_watch_is_not_taken_for_a_new_process_with_that_pid():
    before, after = 4_194_400 + os.getpid(), 4_194_401 + os.getpid()
    log_kill(before)  # the killer ended a process long ago; the kernel may give its pid to a rank
    watch = OomWatch()
    try:
        log_kill(after)
        found = watch.killed({before, after})
    finally:
        watch.close()
    assert list(found) == [after] and f"Killed process {after} (python3)" in found[after]
