"""The operator's node health check (ETT_AGENT_HEALTH_CHECK: e.g. `nvidia-smi`, a disk check): run
at the agent's start, before each launch and every ETT_AGENT_HEALTH_CHECK_INTERVAL_SECONDS. A
failing check is told to the service at registration and in every heartbeat, and the node takes
no new work until it passes again (docs/agent.md, "Health check"); a launch that comes while it
fails is refused, and its job runs elsewhere."""

import shlex
import subprocess
import threading

TIMEOUT_SECONDS = 60.0
DETAIL_CHARS = 300


class HealthCheck:
    def __init__(self, command: str | None, interval_seconds: float) -> None:
        self.argv = shlex.split(command) if command else None
        self.interval_seconds = interval_seconds
        self.problem: str | None = None  # why the node is unhealthy (None: it is not, or no check)
        self._lock = threading.Lock()  # the monitor loop (before a launch) and the periodic thread

    def run(self) -> str | None:
        """Runs the check now; its problem, if any."""
        if self.argv is None:
            return None
        with self._lock:
            try:
                done = subprocess.run(self.argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                      errors="replace", timeout=TIMEOUT_SECONDS)  # fmt: skip
                lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
                problem = None if done.returncode == 0 else f"exit code {done.returncode}" + (
                    f": {lines[-1]}" if lines else "")
            except OSError as exc:
                problem = exc.strerror or str(exc)
            except subprocess.TimeoutExpired:
                problem = f"did not finish within {TIMEOUT_SECONDS:g} s"
            self.problem = None if problem is None else f"health check `{shlex.join(self.argv)}` failed: {problem}"[
                :DETAIL_CHARS]
            return self.problem

    def run_every_interval(self, stop: threading.Event) -> None:
        """The health thread: the check again every interval, until `stop`."""
        while not stop.wait(self.interval_seconds):
            self.run()
