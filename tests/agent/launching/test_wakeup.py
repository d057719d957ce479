"""The monitor loop's pause ends at once for a command or a watched process's exit, and a
process seen to have exited is no longer watched (or every later pause would end at once)."""

import subprocess
import sys
import threading
import time

import pytest

from agent.groups.wakeup import Wakeup, exited, open_pidfd
from tests.agent.helpers import launch_command
from tests.support.waiting import wait_for

LONG = 30.0  # a pause that ends much sooner did not wait for its period


def timed_wait(wakeup: Wakeup, fds: list[int]) -> float:
    started = time.monotonic()
    wakeup.wait(LONG, fds)
    return time.monotonic() - started


def test_wake_from_another_thread_ends_the_pause_and_is_used_up():
    wakeup = Wakeup()
    threading.Timer(0.2, wakeup.wake).start()
    assert timed_wait(wakeup, []) < LONG / 2
    for _ in range(3):
        wakeup.wake()  # several wake-ups before one wait: one early return, then the period again
    assert timed_wait(wakeup, []) < LONG / 2
    started = time.monotonic()
    wakeup.wait(0.3, [])
    assert time.monotonic() - started >= 0.3


def test_a_watched_process_exit_ends_the_pause():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    fd = open_pidfd(child.pid)
    assert fd is not None and not exited(fd)
    assert timed_wait(Wakeup(), [fd]) < LONG / 2
    assert exited(fd)
    child.wait()
    assert open_pidfd(child.pid) is None  # reaped: nothing to watch


@pytest.mark.slow
def test_a_group_wakes_the_monitor_when_its_ranks_and_torchrun_exit_then_stops_watching(supervisor):
    supervisor.launch(launch_command("--steps", "20", "--step-seconds", "0.1"))  # 2 s: watched before the end
    [group] = supervisor.groups.values()
    wakeup = Wakeup()
    wait_for(lambda: len(supervisor.exit_fds) == 3, 60, "torchrun's guard and both runners",
             while_waiting=supervisor.poll)
    while supervisor.groups:
        assert timed_wait(wakeup, supervisor.exit_fds) < LONG / 2, "an exit did not end the pause"
        supervisor.poll()
    assert group.state == "succeeded" and group.exit_fds == []
    assert sorted(group.records.exited) == [0, 1]

