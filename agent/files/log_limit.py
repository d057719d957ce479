"""Root's log of what jobs cause, bounded: a job that fails the agent's reading or its requests in a
loop (a lease on its spool, a flood of bad requests to the placer) gets the first warning of an
interval in full, then one line saying how many more there were (4 MB of root's log in 15 s from
the placer before it, 2.7 KB a second from a leased spool)."""

import logging
import time

WARN_INTERVAL_SECONDS = 10.0


class LogLimit:
    """Warnings to `log` per key (a job's uid, a file): the first of each interval in full, then, once
    that interval is over, how many more there were."""

    def __init__(self, log: logging.Logger, interval: float = WARN_INTERVAL_SECONDS) -> None:
        self.log, self.interval = log, interval
        self._since: dict[str, tuple[float, int]] = {}  # each key's interval's start and warnings held back

    def warn(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        self.flush(now)
        if key in self._since:
            start, held = self._since[key]
            self._since[key] = (start, held + 1)
            return
        self._since[key] = (now, 0)
        self.log.warning(message, *args)

    def flush(self, now: float) -> None:
        """Says, for each key whose interval is over, how many warnings were held back."""
        for key, (start, held) in list(self._since.items()):
            if now - start >= self.interval:
                del self._since[key]
                if held:
                    self.log.warning("%d more like it for %s within %gs", held, key, self.interval)
