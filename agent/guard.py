"""Nothing we start may outlive its parent: the parent-death signal, and an exec wrapper for it.

`python -m agent.guard PARENT_PID -- ARGV...` asks the kernel to SIGKILL this process when its
parent dies, then execs ARGV (the request survives exec). The agent starts torchrun through it,
rather than with a `preexec_fn`, because a `preexec_fn` is unsafe in a process with threads.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def set_parent_death_signal(signum: int = signal.SIGKILL) -> None:
    if _libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m agent.guard PARENT_PID -- ARGV...")
    set_parent_death_signal()
    # The parent may have died before the request was made: then nobody would kill us.
    if os.getppid() != int(argv[0]):
        sys.exit(1)
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
