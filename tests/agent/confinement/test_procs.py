"""What the agent reads of a process in /proc (agent/confinement/procs.py), of real processes."""

import os
import signal
import subprocess
import sys

from agent.confinement.procs import a_thread_runs_or_waits_on_io, cpu_and_state, process_tree, tree_cpu_and_states
from tests.support.waiting import wait_for

# A main thread asleep beside a thread that computes: the leader's state says S, a thread's R.
SPINS_IN_A_THREAD = ("import threading, time\n"
                     "threading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\ntime.sleep(60)")


def test_a_thread_that_computes_is_told_from_a_process_asleep_or_stopped():
    """The frozen-rank check (agent/groups/progress.py) passes over a rank a thread of which runs: a rank
    on a loaded node waiting for a CPU is held up, not frozen; a stopped or sleeping one has none."""
    spinning = subprocess.Popen([sys.executable, "-c", SPINS_IN_A_THREAD])
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for(lambda: (cpu_and_state(spinning.pid) or (0,))[0] > 10, 30, "the thread to compute")
        assert a_thread_runs_or_waits_on_io(spinning.pid)
        assert not a_thread_runs_or_waits_on_io(sleeping.pid)
        os.kill(spinning.pid, signal.SIGSTOP)
        # Each thread stops as it takes the signal: the one computing a moment after the others.
        wait_for(lambda: not a_thread_runs_or_waits_on_io(spinning.pid), 10, "every thread stopped to be told so")
    finally:
        for process in (spinning, sleeping):
            process.kill()
            process.wait()
    assert not a_thread_runs_or_waits_on_io(spinning.pid)  # gone


def test_a_rank_started_through_a_shell_is_read_with_the_process_it_waits_for():
    """A rank run through a wrapper (`bash train.sh`) computes in the wrapper's child: its tree's CPU time
    and states are the rank's (the frozen-rank check reads those), its own pid's alone would say asleep."""
    wrapper = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{SPINS_IN_A_THREAD}"; exit "$?"'])
    try:
        wait_for(lambda: len(process_tree(wrapper.pid)) == 2, 30, "the wrapper's child")
        wait_for(lambda: (tree_cpu_and_states(wrapper.pid) or (0,))[0] > 10, 30, "the child to compute")
        assert cpu_and_state(wrapper.pid)[0] < 10  # the wrapper itself only waits
        assert a_thread_runs_or_waits_on_io(wrapper.pid)
        child = process_tree(wrapper.pid)[1]
        os.kill(child, signal.SIGSTOP)
        wait_for(lambda: tree_cpu_and_states(wrapper.pid)[1] == ["S", "T"], 10, "the child stopped alone")
        os.kill(wrapper.pid, signal.SIGSTOP)
        wait_for(lambda: tree_cpu_and_states(wrapper.pid)[1] == ["T", "T"], 10, "both stopped")
    finally:
        for pid in reversed(process_tree(wrapper.pid)):  # the child first: once the wrapper is gone, it is no one's
            os.kill(pid, signal.SIGKILL)
        wrapper.wait()
    assert tree_cpu_and_states(wrapper.pid) is None  # gone
