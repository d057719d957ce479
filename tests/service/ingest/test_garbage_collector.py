"""The service collects cyclic garbage on a clock (service/asgi/background.py YoungCollector), not by
allocation count: a cycle left by a request is freed within a pass or two even when nothing
else allocates."""

import gc
import time
import weakref

import pytest


class _Cycle:
    def __init__(self) -> None:
        self.itself = self


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_cycle_is_freed_on_the_clock_while_nothing_allocates(service):
    assert gc.get_threshold()[0] >= 100_000  # counted collections are only a backstop
    cycle = _Cycle()
    freed = weakref.ref(cycle)
    del cycle
    deadline = time.monotonic() + 10
    while freed() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert freed() is None
