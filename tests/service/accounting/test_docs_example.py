"""The worked example of docs/ett.md: its table must be what the engine reports."""

import re
from pathlib import Path

import pytest

from service.accounting.memory import MemoryJob
from tests.service.accounting.test_engine_timelines import crash_with_rollback
from tests.service.accounting.timelines import T0

DOC = Path(__file__).resolve().parents[3] / "docs" / "ett.md"


def documented_figures() -> dict[str, float]:
    block = re.search(r"<!-- worked-example.*?-->(.*?)<!-- /worked-example -->", DOC.read_text(), re.S)
    assert block, "docs/ett.md lost its worked-example table"
    rows = re.findall(r"^\| (\w+) \| ([-\d.]+) \|$", block.group(1), re.M)
    return {name: float(value) for name, value in rows}


def test_docs_worked_example_matches_the_engine():
    job = MemoryJob("example")
    job.ingest(crash_with_rollback().events)
    r = job.report(T0 + 100, submitted_at=T0 - 10)
    (failure,) = r["failures"]
    actual = r["seconds"] | r["checkpoints"] | failure | r
    figures = documented_figures()
    assert len(figures) == 17
    for name, value in figures.items():
        assert actual[name] == pytest.approx(value, abs=1e-3), name
