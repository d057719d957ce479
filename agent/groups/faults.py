"""Fault injection for tests and demos: real failures, set off when rank 0 reports a step.

- kill: SIGKILL the rank (the attempt fails with cause signal)
- hang: SIGSTOP the rank (the others block in their next collective; hang detection follows)
- exit: the rank's runner kills it and exits with the fault's code (cause exit); see
  agent.launching.rank_runner, so no trainer support is needed.
- lose_node: the node goes as a dead machine would: every process of the attempt, the job's
  node-local checkpoint folder and the agent itself (WorkerGroup's `lose_node`), with no word to
  the service. Only on agents whose settings allow the drill (agent/confinement/confine.py).

The pids come from the ranks' records, which the job writes: a process is signalled only while
the group owns it by the kernel's word (agent.groups.workers, WorkerGroup.owns), and the exit code is
written into the job's control folder without following a link (agent.files.beneath).
"""

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from agent.files.beneath import open_folder_beneath, replace_beneath
from agent.files.spool import AttemptPaths
from ett.protocol import AGENT_FAULT_ACTIONS, CONTROL_DIR, NODE_LOSS_FAULT, fault_exit_file
from ett.protocol.messages import Fault

log = logging.getLogger(__name__)


class FaultInjector:
    def __init__(self, faults: list[Fault], paths: AttemptPaths, owns: Callable[[int], bool],
                 lose_node: Callable[[], None]) -> None:
        self.pending = sorted((f for f in faults if f.action in AGENT_FAULT_ACTIONS), key=lambda f: f.at_step)
        self.paths = paths
        self.owns = owns
        self.lose_node = lose_node

    def on_step(self, step: int, rank_pids: dict[int, int], runner_pids: dict[int, int]) -> list[Fault]:
        """Carries out the faults due at or before `step`; those done (a rank not started yet, or
        not yet seen in the group, waits)."""
        done = []
        for fault in self.pending:
            if fault.at_step > step:
                break
            pid = rank_pids.get(fault.rank)
            target = pid if fault.action != "exit" else runner_pids.get(fault.rank)
            if target is None or not self.owns(target):
                continue
            self._inject(fault, target)
            done.append(fault)
        self.pending = [f for f in self.pending if all(f is not d for d in done)]
        return done

    def _inject(self, fault: Fault, pid: int) -> None:
        log.warning("fault injection: %s rank %d (pid %d) at step %d", fault.action, fault.rank, pid, fault.at_step)
        try:
            if fault.action == "kill":
                os.kill(pid, signal.SIGKILL)
            elif fault.action == "hang":
                os.kill(pid, signal.SIGSTOP)
            elif fault.action == NODE_LOSS_FAULT:
                self.lose_node()
            else:
                root = self.paths.root
                control = open_folder_beneath(root.parent, Path(root.name) / CONTROL_DIR)
                try:
                    code = 1 if fault.code is None else fault.code
                    replace_beneath(control, fault_exit_file(fault.rank), str(code).encode())
                finally:
                    os.close(control)
                os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            log.warning("fault injection: rank %d already gone", fault.rank)
        except OSError as exc:  # the job's control folder: its trouble, not the agent's
            log.warning("fault injection: rank %d: %s", fault.rank, exc)
