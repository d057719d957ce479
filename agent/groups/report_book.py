"""The latest report of each attempt of this node, for the heartbeats to carry to the service."""

import threading
import time

from agent.groups.states import GroupEnd
from agent.node.kernel_log import KernelLog
from ett.protocol.messages import REPORT_DETAIL_CHARS, AttemptReport

AttemptKey = tuple[str, int]


class ReportBook:
    """The latest report of each attempt, shared by the monitor loop and the heartbeat threads.

    An ended attempt's report is held back (heartbeats say `running`) until the reporter has
    forwarded the events its ranks wrote, or for at most END_WAIT_SECONDS: the service restarts
    from the newest checkpoint it knows of and counts a job done once its nodes report the end,
    so those events must be there first (after a service outage the forwarder may still be in
    backoff). It then stays in every heartbeat until one carrying it is answered 200.

    An ended attempt's report carries the node evidence the kernel logged while it ran
    (agent.node.kernel_log): the agent's own reading, which the service alone counts against the
    node, never what the job printed or how it ended.
    """

    END_WAIT_SECONDS = 30.0

    def __init__(self, kernel: KernelLog | None = None) -> None:
        self._lock = threading.Lock()
        self._reports: dict[AttemptKey, AttemptReport] = {}
        self._held: dict[AttemptKey, float] = {}  # ended attempts not yet released, since when
        self._kernel = kernel or KernelLog()
        self._kernel_from: dict[AttemptKey, int] = {}  # each attempt's first kernel reading (KernelLog.mark)

    def set(self, key: AttemptKey, report: AttemptReport) -> None:
        with self._lock:
            start = self._kernel_from.setdefault(key, self._kernel.mark())
            if report.state != "running" and not report.kernel:
                report = report.model_copy(update={"kernel": self._kernel.since(start)})
            self._reports[key] = report
            if report.state != "running":
                self._held.setdefault(key, time.monotonic())

    def snapshot(self) -> list[AttemptReport]:
        """Every attempt's latest report, held or not."""
        with self._lock:
            return list(self._reports.values())

    def to_send(self) -> list[AttemptReport]:
        """What a heartbeat carries: a held end still as `running`."""
        with self._lock:
            self._kernel.poll()  # every heartbeat: a record is read before the kernel's ring overwrites it
            return [report if key not in self._held else attempt_report(*key, "running", None)
                    for key, report in self._reports.items()]

    def held(self) -> list[AttemptKey]:
        with self._lock:
            return list(self._held)

    def overdue(self) -> bool:
        with self._lock:
            return any(time.monotonic() - since >= self.END_WAIT_SECONDS for since in self._held.values())

    def release(self, keys: list[AttemptKey]) -> None:
        with self._lock:
            for key in keys:
                self._held.pop(key, None)

    def acknowledge(self, sent: list[AttemptReport]) -> None:
        """An ended attempt's report, once answered, is sent no more; a running one's imports (what its
        script loaded, for the job's spares to warm now) are said once."""
        with self._lock:
            for report in sent:
                if self._reports.get(report.key) is not report:
                    continue
                if report.state != "running":
                    del self._reports[report.key]
                    self._kernel_from.pop(report.key, None)
                elif report.imports:
                    self._reports[report.key] = report.model_copy(update={"imports": []})


def attempt_report(job_id: str, attempt: int, state: str, end: GroupEnd | None,
                   imports: list[str] | None = None) -> AttemptReport:
    return AttemptReport(job_id=job_id, attempt=attempt, state=state, cause=end.cause if end else None,
                         detail=end.detail[:REPORT_DETAIL_CHARS] if end else "", exit_code=end.exit_code if end else None,
                         imports=imports or [])
