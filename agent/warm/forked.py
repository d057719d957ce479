"""The agent's side of a warm server forked from another (its user's base server): the request, and the handle kept."""

import contextlib
import json
import os
import select
import signal
import socket
from pathlib import Path

from agent.confinement.uid_sweep import parent_pid
from agent.warm.server import FORK_IMPORTS, FORK_PID, FORK_SOCKET, MAX_REQUEST_BYTES, STALE_EXIT, STALE_WORD

# How long the agent's monitor loop waits for the base server's fork: a fork of a process that holds torch takes
# tens of ms; a base that does not answer by then is taken for one that will not, and a fresh interpreter starts.
FORK_ANSWER_SECONDS = 3.0
# What a forked server's returncode says when it did not say it went stale: its exit status is its parent's (the
# base server's) to read, which ignores it (SIGCHLD), not the agent's.
UNTOLD_EXIT = 1


def channel_pair() -> tuple[int, int]:
    """The agent's end and a server's of the channel between them ($ETT_WARM_STALE_FD): the server says there that
    it went stale, the agent asks there for a server forked from it. Nothing the server forks holds it, so no job
    can say or ask anything there."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return ours.detach(), theirs.detach()


class ForkedServer:
    """A warm server another one forked, which is not the agent's child: the calls of the Popen of one started fresh
    that the agent makes (pid, poll, returncode, kill, wait), through a pidfd, and its channel, on which it says it
    went stale (returncode STALE_EXIT once it ended; UNTOLD_EXIT else). `base`: the socket of the server it was
    forked from, whose end ends it (its parent-death signal)."""

    def __init__(self, pid: int, pidfd: int, channel: socket.socket, base: Path) -> None:
        self.pid, self.base = pid, base
        self.returncode: int | None = None
        self._pidfd, self._channel = pidfd, channel

    def stale_fd(self) -> int:
        """A descriptor of its channel, for the agent to read its word on (WarmServer._said_stale) and close."""
        return os.dup(self._channel.fileno())

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            self._ended()
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            select.select([self._pidfd], [], [])  # readable once it has exited (pidfd_open(2))
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # by its pidfd: never another process given its pid since
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def _ended(self) -> None:
        try:  # its word left unread (the agent reads it only to retire a server that runs on)
            said = self._channel.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == STALE_WORD
        except OSError:
            said = False
        self.returncode = STALE_EXIT if said else UNTOLD_EXIT
        os.close(self._pidfd)
        self._channel.close()


def fork_server(channel: int, base: Path, base_pid: int, socket_path: Path, imports: list[str],
                log_path: Path) -> ForkedServer:
    """Asks the base server (`channel`: the agent's end of its channel; `base`: its socket) to fork a server of
    `imports` that listens at `socket_path` and logs to `log_path`: the handle on it once it is running, a child of
    the base. OSError: refused (the base is stale, or a name is no module name: see its log), gone, or no answer
    within FORK_ANSWER_SECONDS; also a list past what one message on the channel takes (where net.core.wmem_max
    is below MAX_REQUEST_BYTES: the learned lists are about 64 KB), which the fresh interpreter's command line takes."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            request = {FORK_SOCKET: str(socket_path), FORK_IMPORTS: imports}
            with socket.socket(fileno=os.dup(channel)) as to_base:
                to_base.settimeout(FORK_ANSWER_SECONDS)
                # One message: a list of 4,096 names is past the default buffer (208 KiB), not past net.core.wmem_max.
                to_base.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_REQUEST_BYTES)
                socket.send_fds(to_base, [json.dumps(request).encode()], [theirs.fileno(), log])
        finally:
            os.close(log)
            theirs.close()  # the forked server's alone now: its end closes when it ends, or at once when refused
        ours.settimeout(FORK_ANSWER_SECONDS)
        answer = ours.recv(4096)
        if not answer:
            raise ConnectionRefusedError(f"the warm server {base} forked no server of {len(imports)} imports")
        try:
            pid = int(json.loads(answer)[FORK_PID])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConnectionError(f"the warm server {base} answered no pid: {exc!r}") from None
        pidfd = os.pidfd_open(pid)
        if parent_pid(pid) != base_pid:  # gone before its pidfd was opened: not that process any more
            os.close(pidfd)
            raise ProcessLookupError(f"the server forked from {base} ended at once")
        ours.setblocking(False)  # its word is read without waiting (WarmServer._said_stale)
        return ForkedServer(pid, pidfd, ours, base)
    except BaseException:
        ours.close()
        raise
