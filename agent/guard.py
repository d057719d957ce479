"""Nothing of a worker group may outlive the agent: the parent-death signal, and the group's guard.

    python -m agent.guard AGENT_PID -- torchrun ARGV...

The agent starts torchrun through this small process. The guard asks the kernel for SIGUSR1
when the agent dies (PR_SET_PDEATHSIG), and then SIGKILLs every process carrying the group's
marker (agent.procs), so even a rank's own children, which no parent-death signal covers, go.
Otherwise it only waits for torchrun (its child, in its process group) and exits as torchrun
did. SIGTERM sent to the group reaches torchrun directly, so the guard ignores it.
"""

import ctypes
import os
import signal
import subprocess
import sys

from agent.procs import GROUP_MARKER_ENV, signal_marked

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def set_parent_death_signal(signum: int = signal.SIGKILL) -> None:
    if _libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m agent.guard AGENT_PID -- ARGV...")
    marker = os.environ[GROUP_MARKER_ENV]

    def sweep(_signum: int = 0, _frame: object = None) -> None:
        signal_marked(GROUP_MARKER_ENV, marker, signal.SIGKILL, spare=os.getpid())

    signal.signal(signal.SIGUSR1, sweep)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a handler, not SIG_IGN, which torchrun would inherit
    set_parent_death_signal(signal.SIGUSR1)
    if os.getppid() != int(argv[0]):
        return 1  # the agent died before the request above took hold
    child = subprocess.Popen(argv[2:], preexec_fn=set_parent_death_signal)
    returncode = child.wait()
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
