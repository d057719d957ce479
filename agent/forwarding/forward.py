"""Forwards the attempts' JSONL spools to the service: batched, idempotent, never lost.

- The spool files are the on-disk buffer: a line counts as sent only once the service accepted
  it, and only then does its file's read position move on (persisted atomically), so an agent
  restart resends at most one batch, which the service drops by its idempotency key.
- While the service is down or failing, the same batch is retried with exponential backoff and
  jitter; the ranks keep appending meanwhile.
- A batch refused with 422 is not retried as it is: the events the answer names
  (`events.<index>...`) go to a dead-letter file and the rest is sent again. An answer naming
  none is bisected until the bad events stand alone.
- Disk use is bounded by what is not yet forwarded: the forwarded start of a live spool gives
  its blocks back, and the spool of an ended attempt is deleted once all of it is forwarded.

The forwarder is the thread and its timing: when a batch is due, backoff, flushes. Its parts:
the spool files and their positions (agent.forwarding.spool_files), sending a batch and setting
refused events aside (agent.forwarding.delivery), the spool folder's upkeep (agent.forwarding.upkeep),
what the agent says on a rank's events (agent.forwarding.stamp), the ranks' output (agent.forwarding.log_shipper).
"""

import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agent.forwarding.delivery import Delivery, Send
from agent.forwarding.log_shipper import LogShipper
from agent.forwarding.spool_files import PENDING_MAX_BYTES, SpoolFiles, Spooled
from agent.forwarding.stamp import Stamper
from agent.forwarding.upkeep import SpoolUpkeep
from agent.node.metrics import AgentStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardConfig:
    batch_max_events: int = 500
    batch_max_age_seconds: float = 0.5
    retry_base_seconds: float = 0.5
    retry_max_seconds: float = 30.0
    spool_max_bytes: int = 1 << 30


class Forwarder:
    def __init__(self, spool_root: Path, state_dir: Path, send: Send, stats: AgentStats,
                 config: ForwardConfig = ForwardConfig(), logs: LogShipper | None = None) -> None:
        self.stats = stats
        self.config = config
        self.spools = SpoolFiles(spool_root, state_dir)
        self.pending: list[Spooled] = []
        self.failures = 0
        self.stamper = Stamper(spool_root)
        self.logs = logs  # the ranks' output, shipped beside their events (agent/forwarding/log_shipper.py)
        self.upkeep = SpoolUpkeep(self.spools, state_dir / "finished", self.stamper, logs, stats,
                                  config.spool_max_bytes)
        self._flush_waiters: list[threading.Event] = []  # list.append and swap: safe across threads
        self._wake = threading.Event()
        self.delivery = Delivery(send, stats, state_dir / "dead-letters.jsonl")

    def run(self, stop: threading.Event, poll_seconds: float = 0.1) -> None:
        """The forwarding thread: until `stop`, then one last try to send what is read."""
        while not stop.is_set():
            waiters, self._flush_waiters = self._flush_waiters, []
            try:
                forwarded = self.forward_once(flush=bool(waiters))
            except Exception:  # a bug or a full disk must not end forwarding for good
                log.exception("forwarding failed")
                self.failures += 1
                forwarded = False
            for done in waiters if forwarded else ():
                done.set()
            if not forwarded:
                # Cut short by a flush (an attempt's end waits for its events, agent.groups.supervisor's
                # ReportBook) and by wake() at the end.
                self._wake.wait(self._backoff())
                self._wake.clear()
            elif not self._flush_waiters:
                self._wake.wait(poll_seconds)
                self._wake.clear()
        self.forward_once(flush=True)

    def flush(self, timeout: float) -> bool:
        """Asks the forwarding thread to send everything written so far, without waiting for a
        batch to fill; True once it has, False after `timeout` (the service may be down)."""
        done = threading.Event()
        self._flush_waiters.append(done)
        self.wake()
        return done.wait(timeout)

    def wake(self) -> None:
        """Ends a wait (a backoff, the poll period) at once."""
        self._wake.set()

    def forward_once(self, flush: bool) -> bool:
        """Reads new lines and sends batches while one is due, and the ranks' new output; False
        when the service failed us."""
        if self.logs is not None and not self.logs.ship_once():
            self.failures += 1
            return False
        self.upkeep.tidy()
        while self._read_spools() or self.pending:
            if not (flush or self._batch_due()):
                break
            batch = self.pending[: self.config.batch_max_events]
            if not self.delivery.deliver([item for item in batch if not item.done]):
                self.failures += 1
                self.stats.forward_failures += 1
                return False
            self.failures = 0
            self._commit(batch)
        return True

    def _batch_due(self) -> bool:
        return (len(self.pending) >= self.config.batch_max_events
                or time.monotonic() - self.pending[0].read_at >= self.config.batch_max_age_seconds)

    def _backoff(self) -> float:
        limit = min(self.config.retry_max_seconds, self.config.retry_base_seconds * 2 ** (self.failures - 1))
        return limit / 2 + random.uniform(0, limit / 2)  # jitter: agents do not retry in step

    def _read_spools(self) -> bool:
        """Reads on into `pending` (up to a few batches); True when there was something new."""
        room = 4 * self.config.batch_max_events - len(self.pending)
        byte_room = PENDING_MAX_BYTES - sum(item.held for item in self.pending)
        new = self.spools.read_on(room, byte_room, self.stamper.stamped, time.monotonic())
        self.pending.extend(new)
        self.stats.events_buffered = len(self.pending)
        return bool(new)

    def _commit(self, batch: list[Spooled]) -> None:
        self.pending = self.pending[len(batch):]
        self.stats.events_buffered = len(self.pending)
        self.spools.accept(batch)
