"""Nothing of a worker group may outlive the agent: the parent-death signal, and the group's guard.

    python -m agent.guard AGENT_PID -- torchrun ARGV...

The agent starts torchrun through this small process. The guard asks the kernel for SIGUSR1
when the agent dies (PR_SET_PDEATHSIG), and then SIGKILLs every process carrying the group's
marker (agent.procs), so even a rank's own children, which no parent-death signal covers, go.
Otherwise it only waits for torchrun (its child, in its process group) and exits as torchrun
did. SIGTERM sent to the group reaches torchrun directly, so the guard ignores it; a torchrun
forked by the agent's warm server (agent.warm) is in a group of its own: the guard passes it on.
"""

import os
import signal
import sys

from agent.procs import GROUP_MARKER_ENV, set_parent_death_signal, signal_marked
from agent.warm import WARM_SOCKET_ENV, WarmProcess, start_process


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m agent.guard AGENT_PID -- ARGV...")
    marker = os.environ[GROUP_MARKER_ENV]

    def sweep(_signum: int = 0, _frame: object = None) -> None:
        signal_marked(GROUP_MARKER_ENV, marker, signal.SIGKILL, spare=os.getpid())

    child = None

    def pass_on_sigterm(_signum: int, _frame: object) -> None:
        if isinstance(child, WarmProcess):
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGUSR1, sweep)
    signal.signal(signal.SIGTERM, pass_on_sigterm)  # a handler, not SIG_IGN, which torchrun would inherit
    set_parent_death_signal(signal.SIGUSR1)
    if os.getppid() != int(argv[0]):
        return 1  # the agent died before the request above took hold
    child = start_process(argv[2:], os.environ.get(WARM_SOCKET_ENV))
    returncode = child.wait()
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
