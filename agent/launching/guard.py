"""Nothing of a worker group may outlive the agent: the parent-death signal, and the group's guard.

    python -m agent.launching.guard AGENT_PID [--go-fd FD] [--wait-for HOST:PORT] -- torchrun ARGV...

The agent starts torchrun through this small process. The guard asks the kernel for SIGUSR1
when the agent dies (PR_SET_PDEATHSIG), and then SIGKILLs every process carrying the group's
marker (agent.confinement.procs), so even a rank's own children, which no parent-death signal covers, go, and
then every process of the attempt's cgroup, itself included (agent.confinement.cgroups).
Otherwise it only waits for torchrun (its child, in its process group) and exits as torchrun
did. SIGTERM sent to the group reaches torchrun directly, so the guard ignores it; a torchrun
forked by the agent's warm server (agent.warm.server) is in a group of its own: the guard passes it on.

With `--go-fd`, the guard starts nothing until the agent has written a byte there: the agent first
puts it into the attempt's cgroup (agent.confinement.cgroups), so that everything it starts is in there too.

On every node but the master, `--wait-for` the master's torchrun store first: a torchrun whose
store client finds nothing listening backs off, and connected 0.25 to 1 s after a store that came
up 50 to 500 ms after it (bench/store_connect.py; BENCHMARKS.md, "Recovery"), which happens
whenever a node's torchrun starts before the master's. The wait polls every 5 ms; after
WAIT_SECONDS torchrun starts anyway, and its own rendezvous timeout reports a master that never
came.
"""

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

from agent.confinement.procs import GROUP_CGROUP_ENV, GROUP_MARKER_ENV, set_parent_death_signal, signal_marked
from agent.warm.client import WARM_SOCKET_ENV, WarmProcess, start_process

WAIT_SECONDS = 60.0
POLL_SECONDS = 0.005
USAGE = "usage: python -m agent.launching.guard AGENT_PID [--go-fd FD] [--wait-for HOST:PORT] -- ARGV..."


def wait_for_listener(address: str, stopped: Callable[[], bool] = lambda: False, timeout: float = WAIT_SECONDS) -> None:
    """Until a connection to HOST:PORT is accepted, `timeout` passes or `stopped()`."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopped():
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError:
            time.sleep(POLL_SECONDS)


def main(argv: list[str]) -> int:
    options = {}
    while len(argv) >= 3 and argv[1] in ("--go-fd", "--wait-for"):
        options[argv[1]], argv = argv[2], [argv[0], *argv[3:]]
    wait_for = options.get("--wait-for")
    if len(argv) < 3 or argv[1] != "--":
        sys.exit(USAGE)
    marker = os.environ[GROUP_MARKER_ENV]

    def sweep(_signum: int = 0, _frame: object = None) -> None:
        signal_marked(GROUP_MARKER_ENV, marker, signal.SIGKILL, spare=os.getpid())
        cgroup = os.environ.get(GROUP_CGROUP_ENV)
        if cgroup:  # what left the marker behind (setsid, a clean environment) and the guard itself
            with contextlib.suppress(OSError), open(os.path.join(cgroup, "cgroup.kill"), "w") as kill:
                kill.write("1")

    child = None
    stop_requested = []  # a SIGTERM that came before torchrun was started

    def pass_on_sigterm(signum: int, _frame: object) -> None:
        if child is None:
            stop_requested.append(signum)
        elif isinstance(child, WarmProcess):
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGUSR1, sweep)
    signal.signal(signal.SIGTERM, pass_on_sigterm)  # a handler, not SIG_IGN, which torchrun would inherit
    set_parent_death_signal(signal.SIGUSR1)
    if os.getppid() != int(argv[0]):
        return 1  # the agent died before the request above took hold
    if "--go-fd" in options:
        go = int(options["--go-fd"])
        if os.read(go, 1) != b"1":
            return 1  # the agent could not place us, or died first: nothing may start
        os.close(go)
    if wait_for is not None:
        wait_for_listener(wait_for, stopped=lambda: bool(stop_requested))
    if stop_requested:
        return 128 + signal.SIGTERM  # stopped while waiting for the master: nothing to stop
    child = start_process(argv[2:], os.environ.get(WARM_SOCKET_ENV))
    if stop_requested:  # came while torchrun was being started, so it may have missed it
        child.send_signal(signal.SIGTERM)
    returncode = child.wait()
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
