"""Warm start, the asking side: the guard and each rank runner get their process from the agent's
warm server (agent.warm.server) when they can, else start a fresh interpreter.

Kept apart from the server, and light: these two processes start fresh at every launch (the
guard once per node, a runner once per rank), so every import here is paid by every attempt.
"""

import json
import os
import signal
import socket
import subprocess
import sys

from agent.confinement.procs import set_parent_death_signal

WARM_SOCKET_ENV = "ETT_WARM_SOCKET"  # set by the agent for ranks it may start warm
HANDSHAKE_TIMEOUT_SECONDS = 10.0


def python_module(python: str, module: str) -> list[str]:
    """`python -P -m MODULE`: -P keeps the working folder off the import path, so a folder there
    named like one of our packages (agent, trainer) is not imported instead of it."""
    return [python, "-P", "-m", module]


def runs_script(argv: list[str]) -> bool:
    """`python SCRIPT.py ...`: a job's own script, which a warm server of its imports may start."""
    return len(argv) >= 2 and argv[1].endswith(".py")


def start_process(argv: list[str], warm_socket: str | None, output: int | None = None,
                  **popen: object) -> "subprocess.Popen[bytes] | WarmProcess":
    """From the warm server when there is one and it can (its process group is its own), else a
    fresh process with the parent-death signal set and `popen`; `warm_socket`: $ETT_WARM_SOCKET.
    `output`: a descriptor for its stdout and stderr (default: ours)."""
    if warm_socket:
        try:
            return WarmProcess(warm_socket, argv, [0, 1, 2] if output is None else [0, output, output])
        except (OSError, ValueError, KeyError) as exc:
            print(f"agent.warm: no warm start for {argv[3:4]} ({exc!r}); starting a fresh interpreter",
                  file=sys.stderr, flush=True)
    if output is not None:
        popen |= {"stdout": output, "stderr": output}
    return subprocess.Popen(argv, preexec_fn=set_parent_death_signal, **popen)


class WarmProcess:
    """A process forked by the server: the few calls of the Popen it stands in for."""

    def __init__(self, socket_path: str, argv: list[str], fds: list[int] = [0, 1, 2],  # noqa: B006 (read only)
                 env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        """`env` and `cwd`: the process's (default: ours, as a fresh process inherits them)."""
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._conn.settimeout(HANDSHAKE_TIMEOUT_SECONDS)  # a stuck server must not stall the launch
            self._conn.connect(socket_path)
            request = {"argv": argv, "env": dict(os.environ) if env is None else env, "cwd": cwd or os.getcwd()}
            socket.send_fds(self._conn, [json.dumps(request).encode()], fds)
            self.pid = int(self._answer()["pid"])
            self._conn.settimeout(None)
        except BaseException:
            self._conn.close()
            raise

    def _answer(self) -> dict:
        message = self._conn.recv(4096)
        if not message:
            raise ConnectionError("the warm server closed the connection")
        return json.loads(message)

    def fileno(self) -> int:
        """Readable once it has ended (its keeper's word): for select."""
        return self._conn.fileno()

    def send_signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int:
        try:
            return int(self._answer()["returncode"])
        except (OSError, ValueError, KeyError):
            return -signal.SIGKILL  # the keeper is gone, and with it (parent-death signal) the rank
        finally:
            self._conn.close()
