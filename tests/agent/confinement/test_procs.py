"""What the agent reads of a process in /proc (agent/confinement/procs.py), of real processes."""

import os
import signal
import subprocess
import sys

from agent.confinement.procs import a_thread_runs_or_waits_on_io, cpu_and_state
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
