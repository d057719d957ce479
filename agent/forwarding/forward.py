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
- Attempts are served in turn: each pass reads at most a batch ahead for each attempt, starting
  with another each time, and a batch takes a share from each attempt that has events waiting; a
  pass sends at most MAX_BATCHES_PER_PASS batches. A flush asked for some attempts (an attempt's
  end waits for its events) is done once those are in, whatever another job's backlog. So one
  job's flood of events never holds another owner's events or end behind it.
- Spools of ranks beyond an attempt's world (agent.forwarding.launches) are set aside unread, with
  one dead letter for the attempt: a job may lay any number of them.

The forwarder is the thread and its timing: when a batch is due, backoff, flushes. Its parts:
the spool files and their positions (agent.forwarding.spool_files), sending a batch and setting
refused events aside (agent.forwarding.delivery), the spool folder's upkeep (agent.forwarding.upkeep),
what the agent says on a rank's events (agent.forwarding.stamp), the ranks' output (agent.forwarding.log_shipper).
"""

import logging
import random
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from agent.forwarding.delivery import Delivery, Send
from agent.forwarding.launches import Launches
from agent.forwarding.log_shipper import LogShipper
from agent.forwarding.spool_files import PENDING_MAX_BYTES, SpoolFiles, Spooled
from agent.forwarding.stamp import Stamper
from agent.forwarding.upkeep import SpoolUpkeep
from agent.node.metrics import AgentStats

log = logging.getLogger(__name__)
# A pass's bound on batches sent, so that a backlog never keeps the thread from its flushes' answers
# and the ranks' output; the next pass follows at once while batches are due.
MAX_BATCHES_PER_PASS = 4
# A flush's wait: the attempts it waits for (None: all), its signal, when its caller stops waiting.
Waiter = tuple[frozenset[str] | None, threading.Event, float]


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
        # What the agent knows of each attempt's launch: its world, its checkpoint folder, its secrets.
        self.launches = logs.launches if logs is not None else Launches(spool_root)
        self.spools = SpoolFiles(spool_root, state_dir, self.launches)
        self.pending: dict[str, list[Spooled]] = {}  # JOB_ID/ATTEMPT -> its lines read, not yet sent
        self.failures = 0
        self.stamper = Stamper(spool_root, self.launches)
        self.logs = logs  # the ranks' output, shipped beside their events (agent/forwarding/log_shipper.py)
        self.upkeep = SpoolUpkeep(self.spools, state_dir / "finished", self.stamper, logs, stats,
                                  config.spool_max_bytes)
        self._flush_waiters: list[Waiter] = []  # list.append and swap: safe across threads
        self._wake = threading.Event()
        self.delivery = Delivery(send, stats, state_dir / "dead-letters.jsonl")
        self._turn = 0  # which attempt is read first this pass: each in turn
        self._listed: set[str] = set()  # the attempts with spools, at the last read
        self._read_out: set[str] = set()  # ... of those, the ones read to their end then
        self._said_beyond: set[str] = set()  # attempts whose spools beyond their world have their dead letter
        self._busy = False  # the last pass stopped at its bound with batches due

    def run(self, stop: threading.Event, poll_seconds: float = 0.1) -> None:
        """The forwarding thread: until `stop`, then one last try to send what is read."""
        waiting: list[Waiter] = []
        while not stop.is_set():
            new, self._flush_waiters = self._flush_waiters, []
            waiting = [w for w in waiting + new if w[2] > time.monotonic()]  # the others' callers gave up
            everything = any(attempts is None for attempts, _, _ in waiting)
            wanted = {a for attempts, _, _ in waiting if attempts is not None for a in attempts}
            try:
                forwarded = self.forward_once(flush=everything, attempts=wanted)
            except Exception:  # a bug or a full disk must not end forwarding for good
                log.exception("forwarding failed")
                self.failures += 1
                forwarded = False
            if forwarded:
                for waiter in [w for w in waiting if w[0] is None or all(map(self._forwarded, w[0]))]:
                    waiter[1].set()
                    waiting.remove(waiter)
            if not forwarded:
                # Cut short by a flush (an attempt's end waits for its events, agent.groups.supervisor's
                # ReportBook) and by wake() at the end.
                self._wake.wait(self._backoff())
                self._wake.clear()
            elif not self._flush_waiters and not self._busy:
                self._wake.wait(poll_seconds)
                self._wake.clear()
        self.forward_once(flush=True)

    def flush(self, timeout: float, attempts: Collection[tuple[str, int]] | None = None) -> bool:
        """Asks the forwarding thread to send everything written so far of these attempts ((job id,
        attempt); None: of all), without waiting for a batch to fill; True once it has, False after
        `timeout` (the service may be down)."""
        done = threading.Event()
        wanted = None if attempts is None else frozenset(f"{job_id}/{attempt}" for job_id, attempt in attempts)
        self._flush_waiters.append((wanted, done, time.monotonic() + timeout))
        self.wake()
        return done.wait(timeout)

    def wake(self) -> None:
        """Ends a wait (a backoff, the poll period) at once."""
        self._wake.set()

    def forward_once(self, flush: bool, attempts: Collection[str] = ()) -> bool:
        """Reads new lines and sends batches while one is due (all that is read when `flush`, at
        most MAX_BATCHES_PER_PASS otherwise), and the ranks' new output; False when the service
        failed us. `attempts` (JOB_ID/ATTEMPT): those whose lines are due now, whatever their age."""
        if self.logs is not None and not self.logs.ship_once():
            self.failures += 1
            return False
        self.upkeep.tidy()
        self._busy, sent = False, 0
        while self._read_spools() or any(self.pending.values()):
            if not (flush or self._batch_due(attempts)):
                break
            if not flush and sent >= MAX_BATCHES_PER_PASS:
                self._busy = True
                break
            batch = self._fair_batch()
            if not self.delivery.deliver([item for _, items in batch for item in items if not item.done]):
                self.failures += 1
                self.stats.forward_failures += 1
                return False
            self.failures = 0
            self._commit(batch)
            sent += 1
        return True

    def _forwarded(self, attempt: str) -> bool:
        """Whether all that is written of the attempt's spools is with the service (or it has none left)."""
        return not self.pending.get(attempt) and (attempt in self._read_out or attempt not in self._listed)

    def _batch_due(self, attempts: Collection[str]) -> bool:
        queues = [items for items in self.pending.values() if items]
        if not queues:
            return False
        return (sum(map(len, queues)) >= self.config.batch_max_events
                or any(self.pending.get(attempt) for attempt in attempts)
                or time.monotonic() - min(items[0].read_at for items in queues) >= self.config.batch_max_age_seconds)

    def _backoff(self) -> float:
        limit = min(self.config.retry_max_seconds, self.config.retry_base_seconds * 2 ** (self.failures - 1))
        return limit / 2 + random.uniform(0, limit / 2)  # jitter: agents do not retry in step

    def _read_spools(self) -> bool:
        """Reads on into `pending`, each attempt in turn up to a batch ahead, all of them within the
        bound on memory; True when there was something new."""
        by_attempt = self.spools.by_attempt()
        self._set_aside_beyond_world()
        order = sorted(by_attempt)
        self._turn = (self._turn + 1) % max(1, len(order))
        order = order[self._turn :] + order[: self._turn]
        room = 4 * self.config.batch_max_events - sum(map(len, self.pending.values()))
        byte_room = PENDING_MAX_BYTES - sum(item.held for items in self.pending.values() for item in items)
        self._listed, self._read_out = set(order), set()
        new_lines = False
        for attempt in order:
            queue = self.pending.setdefault(attempt, [])
            share = min(room, self.config.batch_max_events - len(queue))
            new, to_the_end = self.spools.read_on(by_attempt[attempt], share, byte_room, self.stamper.stamped,
                                                  time.monotonic())
            queue.extend(new)
            if to_the_end:
                self._read_out.add(attempt)
            room -= len(new)
            byte_room -= sum(item.held for item in new)
            new_lines = new_lines or bool(new)
        self.pending = {attempt: items for attempt, items in self.pending.items() if items}
        self.stats.events_buffered = sum(map(len, self.pending.values()))
        return new_lines

    def _set_aside_beyond_world(self) -> None:
        """One dead letter per attempt for its spools of ranks beyond its world, which are never read."""
        for attempt, names in self.spools.beyond.items():
            if attempt not in self._said_beyond:
                self._said_beyond.add(attempt)
                world = self.launches.of(attempt).world
                self.delivery.note(f"{attempt}/events", f"{len(names)} spools of ranks beyond the attempt's {world} "
                                   f"set aside unread: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}")

    def _fair_batch(self) -> list[tuple[str, list[Spooled]]]:
        """The next batch: an equal share of it from each attempt with lines waiting, as far as each has."""
        queues = {attempt: items for attempt, items in self.pending.items() if items}
        taken = dict.fromkeys(queues, 0)
        left = self.config.batch_max_events
        while left > 0:
            live = [attempt for attempt, items in queues.items() if taken[attempt] < len(items)]
            if not live:
                break
            share = max(1, left // len(live))
            for attempt in live:
                more = min(share, len(queues[attempt]) - taken[attempt], left)
                taken[attempt] += more
                left -= more
        return [(attempt, queues[attempt][:count]) for attempt, count in taken.items() if count]

    def _commit(self, batch: list[tuple[str, list[Spooled]]]) -> None:
        for attempt, items in batch:
            self.pending[attempt] = self.pending[attempt][len(items):]
        self.stats.events_buffered = sum(map(len, self.pending.values()))
        self.spools.accept([item for _, items in batch for item in items])
