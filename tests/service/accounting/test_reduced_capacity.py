"""Reduced capacity (docs/ett.md, "Reduced capacity"): an elastic job's attempt on n of its N nodes
books (N - n) / N of each productive second beside ETT%, whose categories do not change."""

import random
import re
from pathlib import Path

import pytest

from service.accounting.memory import MemoryJob
from tests.service.accounting.test_engine_timelines import check, crash_with_rollback, report_of
from tests.service.accounting.timelines import T0, Timeline

DOC = Path(__file__).resolve().parents[3] / "docs" / "ett.md"


def shrinks_and_grows_back(t0: float = T0) -> Timeline:
    """The worked example of docs/ett.md, "Reduced capacity": a 2-node job loses a node, goes on
    on the other at half size (its steps twice as long: the global batch is kept) and grows back."""
    tl = Timeline(t0)
    tl.service("attempt_allocated", 0, 0, nodes=["n0", "n1"])
    tl.rank0("init_end", 10, 0)
    tl.steps(0, 1, 10, start=10, duration=2)  # ends 30
    tl.checkpoint(0, 10, start=30, staged=30.5, committed=31)
    tl.steps(0, 11, 12, start=30.5, duration=2)  # ends 34.5; rolled back by attempt 1's restore of step 10
    tl.service("attempt_failed", 35, 0, cause="node_lost", detail="n1 lost")
    tl.service("attempt_allocated", 36, 1, nodes=["n0"], full_nodes=2)
    tl.rank0("init_end", 40, 1)
    tl.rank0("restore_start", 40, 1, 10)
    tl.rank0("restore_end", 42, 1, 10)
    tl.steps(1, 11, 20, start=42, duration=4)  # ends 82
    tl.checkpoint(1, 20, start=82, staged=83, committed=84)
    tl.service("attempt_stopped", 84, 1, reason="growing back to 2 nodes")
    tl.service("attempt_allocated", 85, 2, nodes=["n0", "n1"])
    tl.rank0("init_end", 89, 2)
    tl.rank0("restore_start", 89, 2, 20)
    tl.rank0("restore_end", 91, 2, 20)
    tl.steps(2, 21, 30, start=91, duration=2)  # ends 111
    tl.service("job_finished", 112, 2, state="succeeded")
    return tl


def documented_figures() -> dict[str, float]:
    block = re.search(r"<!-- reduced-capacity-example.*?-->(.*?)<!-- /reduced-capacity-example -->", DOC.read_text(), re.S)
    assert block, "docs/ett.md lost its reduced-capacity example"
    return {name: float(value) for name, value in re.findall(r"^\| (\w+) \| ([-\d.]+) \|$", block.group(1), re.M)}


def test_an_attempt_at_half_size_books_half_its_productive_time_as_reduced_capacity():
    r = report_of(shrinks_and_grows_back(), now=200)
    # attempt 0 [0, 36): init 10, steps 24 of which 11-12 (4 s) wasted, save 0.5, recovery 34.5 -> 36
    # attempt 1 [36, 85): init 4, restore 2, productive 40 (10 steps of 4 s on 1 of 2 nodes), save 1, idle 2
    # attempt 2 [85, 112]: init 4, restore 2, productive 20, idle 1
    check(r, 112, productive=80, wasted=4, checkpoint_save=1.5, restore=4, init=18, recovery=1.5, idle=3)
    assert r["reduced_capacity_seconds"] == pytest.approx(40 * (2 - 1) / 2)
    # productive node-seconds (20 x 2 + 40 x 1 + 20 x 2 = 120) over wall x full size (112 x 2)
    assert r["capacity_percent"] == pytest.approx(100 * 120 / 224)
    assert r["capacity_percent"] == pytest.approx(r["ett_percent"] - 100 * r["reduced_capacity_seconds"] / 112)
    assert [(s["attempt"], s["nodes"], s["full_nodes"]) for s in r["attempt_sizes"]] == [(0, 2, 2), (1, 1, 2), (2, 2, 2)]
    assert [s["reduced_capacity_seconds"] for s in r["attempt_sizes"]] == pytest.approx([0, 20, 0])
    assert r["failures"][0]["lost_steps"] == 2  # the rollback rule is the same at any size
    documented = documented_figures()
    assert len(documented) == 11
    actual = r["seconds"] | r
    for name, value in documented.items():
        assert actual[name] == pytest.approx(value, abs=1e-3), name


@pytest.mark.parametrize("nodes", [["n1"], ["n0", "n1", "n2", "n3"]])
def test_a_job_that_never_shrank_books_none_and_its_capacity_is_its_ett(nodes):
    tl = crash_with_rollback()
    tl.events = [e if e.kind != "attempt_allocated" else type(e)(e.kind, e.ts, e.attempt, e.source, e.seq, e.step,
                                                                  {"nodes": nodes}) for e in tl.events]  # fmt: skip
    r = report_of(tl, now=100)
    assert r["reduced_capacity_seconds"] == 0.0
    assert r["capacity_percent"] == pytest.approx(r["ett_percent"]) and r["ett_percent"] == pytest.approx(100 * 24 / 58)
    assert {s["nodes"] for s in r["attempt_sizes"]} == {len(nodes)}


def test_reduced_capacity_does_not_depend_on_the_order_events_arrive_in():
    tl = shrinks_and_grows_back()
    # A second allocation event of attempt 1, later, as a replay of another record might send: the first tells.
    tl.service("attempt_allocated", 37, 1, nodes=["n0", "n1"])
    events = tl.events
    expected = report_of(tl, now=200)
    assert [s["nodes"] for s in expected["attempt_sizes"]] == [2, 1, 2]
    for seed in range(5):
        shuffled = events[:]
        random.Random(seed).shuffle(shuffled)
        job = MemoryJob("j")
        for i in range(0, len(shuffled), 7):  # in batches, the allocations among the last for some seeds
            job.ingest(shuffled[i : i + 7])
        r = job.report(T0 + 200)
        assert r["reduced_capacity_seconds"] == pytest.approx(expected["reduced_capacity_seconds"]), seed
        assert r["attempt_sizes"] == expected["attempt_sizes"]
