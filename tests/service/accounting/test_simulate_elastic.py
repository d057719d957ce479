"""Elastic against waiting for a spare (service/accounting/simulate_elastic.py, `ett simulate
--elastic-vs-waiting`): the same work and failures, accounted by the real engine."""

import pytest

from ett_cli.main import main
from service.accounting.simulate import FleetModel
from service.accounting.simulate_elastic import ElasticModel, elastic_vs_waiting

# 64 nodes, a failure every 4 h held, 3 days of work: a node lost is 1/64 of the job, so its
# reduced capacity shows beside ETT.
SMALL = FleetModel(nodes=64, days=3, mtbf_seconds=4 * 3600, seed=3)


def test_short_of_spares_the_elastic_job_keeps_training_and_ends_sooner():
    waiting, elastic = elastic_vs_waiting(ElasticModel(SMALL, spares=0, spare_wait_seconds=6 * 3600))
    w, e = waiting.report, elastic.report
    assert e["ett_percent"] > w["ett_percent"] + 20 and e["capacity_percent"] > w["capacity_percent"] + 20
    assert e["wall_seconds"] < 0.8 * w["wall_seconds"]
    # The same work: 3 days of full-size steps productive in each (the elastic one's at reduced size too).
    assert w["seconds"]["productive"] == pytest.approx(3 * 86400, rel=1e-3)
    assert e["seconds"]["productive"] > w["seconds"]["productive"]
    # Waiting idles the whole job (recovery); elastic goes on at reduced capacity instead.
    assert w["seconds"]["recovery"] > 20 * e["seconds"]["recovery"]
    assert w["reduced_capacity_seconds"] == 0 and w["capacity_percent"] == pytest.approx(w["ett_percent"])
    assert e["reduced_capacity_seconds"] > 0 and e["capacity_percent"] < e["ett_percent"]
    assert elastic.reduced_attempts > 0 and waiting.reduced_attempts == 0
    # It grows back at a checkpoint once a spare returns: restarts that no failure caused.
    assert e["restarts"] > len(e["failures"]) and w["restarts"] == len(w["failures"])
    sizes = {(s["nodes"], s["full_nodes"]) for s in e["attempt_sizes"]}
    assert (64, 64) in sizes and any(n < 64 for n, _ in sizes) and {full for _, full in sizes} == {64}


def test_with_spares_to_spare_both_runs_are_the_same():
    waiting, elastic = elastic_vs_waiting(ElasticModel(SMALL, spares=16, spare_wait_seconds=6 * 3600))
    assert elastic.report == waiting.report | {"job_id": "elastic"}
    assert elastic.reduced_attempts == 0 and waiting.report["failures"]


def test_the_elastic_job_waits_below_its_smallest_size():
    # No spare and 63 of 64 as the floor: a second loss within a repair makes it wait as well.
    waiting, strict = elastic_vs_waiting(ElasticModel(SMALL, spares=0, spare_wait_seconds=6 * 3600, min_nodes=63))
    _, loose = elastic_vs_waiting(ElasticModel(SMALL, spares=0, spare_wait_seconds=6 * 3600, min_nodes=1))
    assert {s["nodes"] for s in strict.report["attempt_sizes"]} == {63, 64}
    assert loose.report["seconds"]["recovery"] < strict.report["seconds"]["recovery"] < \
        waiting.report["seconds"]["recovery"]


def test_the_command_prints_both_runs_side_by_side(capsys):
    assert main(["simulate", "--elastic-vs-waiting", "--days", "1", "--spares", "0"]) == 0
    out = capsys.readouterr().out
    assert "16,384 GPUs" in out and "spares 0" in out
    rows = {line[2:28].strip(): line[28:].split() for line in out.splitlines() if line.startswith("  ")}
    assert rows[""] == ["waiting", "elastic"]
    for row in ("wall time (days)", "ETT", "capacity", "reduced capacity (h)", "recovery (h)", "attempts at reduced size"):
        assert len(rows[row]) == 2, row
    ett_waiting, ett_elastic = (float(v.rstrip("%")) for v in rows["ETT"])
    assert ett_elastic > ett_waiting
    assert main(["simulate", "--elastic-vs-waiting", "--min-nodes", "4096"]) == 2
    assert "min_nodes must be between 1 and nodes (2048), got 4096" in capsys.readouterr().err
