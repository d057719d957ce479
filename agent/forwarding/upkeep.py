"""The spool folder's upkeep, between the forwarder's batches: disk use is bounded by what is not
yet forwarded. The spool of an ended attempt is deleted once all of it is forwarded and its logs
are shipped (its logs move to DATA_DIR/finished, so the spool folder only ever holds live or
unforwarded attempts and scanning it stays cheap). The disk the spools use is counted, and a
warning is logged while it is above its bound (events are never dropped to get under it).
"""

import contextlib
import logging
import os
from pathlib import Path

from agent.files.beneath import remove_tree
from agent.files.spool import AttemptPaths, disk_bytes
from agent.forwarding.log_shipper import LogShipper
from agent.forwarding.spool_files import SpoolFiles
from agent.forwarding.stamp import Stamper
from agent.node.metrics import AgentStats

log = logging.getLogger(__name__)


class SpoolUpkeep:
    def __init__(self, spools: SpoolFiles, finished_root: Path, stamper: Stamper, logs: LogShipper | None,
                 stats: AgentStats, max_bytes: int) -> None:
        self.spools = spools
        self.spool_root = spools.spool_root
        self.finished_root = finished_root  # where an ended attempt's logs go once its events are all forwarded
        self.stamper = stamper
        self.logs = logs
        self.stats = stats
        self.max_bytes = max_bytes

    def tidy(self) -> None:
        """Deletes the spools of ended attempts once forwarded; counts the disk the rest use."""
        sizes: dict[Path, int] = {}
        forwarded: dict[Path, bool] = {}
        backlog = 0
        for path in self.spools.paths():
            relative = path.relative_to(self.spool_root)
            acked = self.spools.acked.get(str(relative), 0)
            attempt_dir = self.spool_root / relative.parts[0] / relative.parts[1]
            try:
                size, used = path.lstat().st_size, disk_bytes(path)
            except OSError:  # removed by its job since listed
                continue
            sizes[attempt_dir] = sizes.get(attempt_dir, 0) + used
            forwarded[attempt_dir] = forwarded.get(attempt_dir, True) and acked == size
            backlog += size - acked
        for attempt_dir, done in forwarded.items():
            shipped = self.logs is None or self.logs.shipped(attempt_dir)
            if done and shipped and AttemptPaths(attempt_dir).ended_marker.exists():
                self._retire(attempt_dir)
                del sizes[attempt_dir]
        total = sum(sizes.values())
        if total > self.max_bytes >= self.stats.spool_bytes:
            log.warning("event spools use %d bytes, above their bound of %d", total, self.max_bytes)
        self.stats.spool_bytes, self.stats.backlog_bytes = total, backlog

    def _retire(self, attempt_dir: Path) -> None:
        """An ended attempt, all forwarded: its events go, the rest (logs) moves out of the spool."""
        events_dir = AttemptPaths(attempt_dir).events_dir
        remove_tree(events_dir)  # the job's folder: any depth, no link followed
        if events_dir.exists():
            log.warning("%s could not be removed; the attempt stays in the spool", events_dir)
            return
        finished = self.finished_root / attempt_dir.relative_to(self.spool_root)
        remove_tree(finished)
        finished.parent.mkdir(parents=True, exist_ok=True)
        os.replace(attempt_dir, finished)
        with contextlib.suppress(OSError):
            attempt_dir.parent.rmdir()  # the job's folder, once its last attempt is out
        self.stamper.forget(str(attempt_dir.relative_to(self.spool_root)))
        if self.logs is not None:
            self.logs.forget(str(attempt_dir.relative_to(self.spool_root)))
        self.spools.forget(str(attempt_dir.relative_to(self.spool_root)))
