"""Fault injection for tests and demos: real failures, set off when rank 0 reports a step.

- kill: SIGKILL the rank (the attempt fails with cause signal)
- hang: SIGSTOP the rank (the others block in their next collective; hang detection follows)
- exit: the rank's runner kills it and exits with the fault's code (cause exit); see
  agent.rank_runner, so no trainer support is needed.
"""

import logging
import os
import signal
from pathlib import Path

from ett.protocol import fault_exit_file
from ett.protocol.messages import Fault

log = logging.getLogger(__name__)


class FaultInjector:
    def __init__(self, faults: list[Fault], control_dir: Path) -> None:
        self.pending = sorted(faults, key=lambda f: f.at_step)
        self.control_dir = control_dir

    def on_step(self, step: int, rank_pids: dict[int, int], runner_pids: dict[int, int]) -> list[Fault]:
        """Carries out the faults due at or before `step`; those done (a rank not started yet waits)."""
        done = []
        for fault in self.pending:
            if fault.at_step > step:
                break
            if fault.rank not in rank_pids:
                continue
            self._inject(fault, rank_pids[fault.rank], runner_pids[fault.rank])
            done.append(fault)
        self.pending = [f for f in self.pending if all(f is not d for d in done)]
        return done

    def _inject(self, fault: Fault, pid: int, runner_pid: int) -> None:
        log.warning("fault injection: %s rank %d (pid %d) at step %d", fault.action, fault.rank, pid, fault.at_step)
        try:
            if fault.action == "kill":
                os.kill(pid, signal.SIGKILL)
            elif fault.action == "hang":
                os.kill(pid, signal.SIGSTOP)
            else:
                (self.control_dir / fault_exit_file(fault.rank)).write_text(str(1 if fault.code is None else fault.code))
                os.kill(runner_pid, signal.SIGUSR1)
        except ProcessLookupError:
            log.warning("fault injection: rank %d already gone", fault.rank)
