"""The monitor loop's pause: a period, cut short by a command or by the exit of a watched process.

A fixed poll period (0.1 s) put on average half of it between a rank's death and its attempt's
failure, between a launch command's arrival and the launch, and between a job's last rank exit
and its end: every restart paid it two or three times. Now the loop sleeps in `select` on a
self-pipe (other threads call `wake()`) and on pidfds (Linux 5.3+) of the processes it watches,
and the period only bounds the wait for what no descriptor says: new steps, hangs.

A pidfd stays readable once its process has exited, so a caller stops watching a process as soon
as it has seen it end (`exited`, `ExitWatch`); otherwise every wait would return at once.
"""

import os
import select


class Wakeup:
    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def wake(self) -> None:
        """From any thread or a signal handler: the current or next wait returns at once."""
        try:
            os.write(self._write_fd, b"!")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is pending anyway

    def wait(self, seconds: float, fds: list[int]) -> None:
        """Until `seconds` pass, `wake()` is called or one of the pidfds `fds` is readable."""
        readable, _, _ = select.select([self._read_fd, *fds], [], [], seconds)
        if self._read_fd in readable:
            try:
                while os.read(self._read_fd, 4096):
                    pass
            except BlockingIOError:
                pass


def open_pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process `pid` exits; None when it is gone already
    (or the kernel has no pidfds: the period alone then bounds the wait, as before)."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def exited(fd: int) -> bool:
    """Whether the process of pidfd `fd` has exited (the descriptor is readable)."""
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)


class ExitWatch:
    """A group's watched processes (torchrun's guard, the rank runners): a pidfd each, closed once
    its process is seen to have exited, so that no wait returns at once for an old exit."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> pidfd

    def __contains__(self, pid: object) -> bool:
        return pid in self._fds

    @property
    def fds(self) -> list[int]:
        return list(self._fds.values())

    def watch(self, pid: int) -> None:
        fd = open_pidfd(pid)
        if fd is not None:
            self._fds[pid] = fd

    def forget_exited(self, everything: bool = False) -> None:
        """Closes the pidfds of the processes that have exited (`everything`: of all of them)."""
        for pid, fd in list(self._fds.items()):
            if everything or exited(fd):
                os.close(self._fds.pop(pid))
