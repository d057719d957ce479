"""The suite's one way to wait: for a condition, and nothing else."""

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05,
             while_waiting: Callable[[], object] | None = None, explain: Callable[[], str] | None = None) -> T:
    """Looks at `condition` every `interval` seconds until it gives something true, and returns that.
    After `timeout` seconds: TimeoutError naming `what` (and `explain()`, a log say). `while_waiting`
    is called before each look to drive what is watched (a supervisor's poll); what it returns is
    ignored, so only the condition ends the wait."""
    deadline = time.monotonic() + timeout
    while True:
        if while_waiting is not None:
            while_waiting()
        if result := condition():
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}"
                               + (f"\n{explain()}" if explain is not None else ""))
        time.sleep(interval)
