"""The fleet simulator (`ett simulate`): its ETT against the model's analytical value, Young's
interval against the simulated optimum, and a replay through a live service.

Tolerance of the ETT check: the simulation is random, the formula an expectation. Over 16 seeds
of the default 54-day job, simulated minus analytical ETT had mean +0.07 and standard deviation
0.46 percentage points; the test simulates 216 days (4 times as many failures, so about 0.23 pp)
and allows 0.75 pp. Step events are coarse (10 minutes of training each; the checkpoint interval
is a whole number of them, so the model is the same) to keep the CPU time to about a second.
"""

import json
import math
import time

import pytest

from ett_cli.main import main
from service.accounting.simulate import (
    expected_ett,
    llama3_405b,
    memory_report,
    simulate,
    sweep,
    young_interval_seconds,
)

END = 1.9e9  # any end time: the accounting does not depend on it


def test_simulated_ett_matches_the_renewal_reward_expectation():
    model = llama3_405b(days=216, steps_per_event=60)  # 10-minute step events; a checkpoint every 3
    events, report = memory_report(model, END)
    assert model.interval_seconds == 1800
    assert report["ett_percent"] == pytest.approx(100 * expected_ett(model), abs=0.75)
    # The failure process is the one asked for: cycles of M + R on average (Poisson count, 4 sd).
    cycles = model.days * 86400 / (model.mtbf_seconds + model.restart_seconds)
    assert abs(len(report["failures"]) - cycles) < 4 * math.sqrt(cycles)
    # Exact, whatever the failures: the kept steps are the final model's history, each step once.
    final_step = max(e["step"] for e in events if e["kind"] == "step" and e["attempt"] == events[-1]["attempt"])
    assert report["seconds"]["productive"] == pytest.approx(final_step * model.step_seconds)
    blocking = sum(e["kind"] == "ckpt_staged" for e in events) * model.checkpoint_blocking_seconds
    assert report["seconds"]["checkpoint_save"] == pytest.approx(blocking)
    assert sum(report["seconds"].values()) == pytest.approx(report["wall_seconds"])
    assert events[-1]["kind"] == "job_finished" and events[-1]["ts"] == END


def test_first_order_formula_is_close_to_the_exact_one():
    # 1 - C/T - (T/2 + C/2 + I + S + W + R)/M, the form quoted in docs/reliability.md.
    m = llama3_405b()
    T, C, M = m.interval_seconds, m.checkpoint_blocking_seconds, m.mtbf_seconds
    rest = m.init_seconds + m.restore_seconds + m.checkpoint_write_seconds + m.restart_seconds
    first_order = 1 - C / T - (T / 2 + C / 2 + rest) / M
    assert first_order == pytest.approx(expected_ett(m), abs=0.02)


def test_recommended_interval_lands_near_the_simulated_optimum():
    # 4-minute step events, so the intervals are whole numbers of them; the same failure times
    # at every interval.
    runs = sweep(llama3_405b(steps_per_event=24), [480, 720, 1200, 1920], END)
    rows = [(m.interval_seconds, r["ett_percent"], 100 * expected_ett(m)) for m, r in runs]
    recommended = runs[-1][1]["recommended_checkpoint_interval_seconds"]  # the report at 1920 s
    assert recommended == pytest.approx(young_interval_seconds(runs[-1][0]), rel=0.15)
    best_interval, best_ett, _ = max(rows, key=lambda row: row[1])
    nearest = min(rows, key=lambda row: abs(row[0] - recommended))
    print(f"recommended {recommended:.0f} s; (interval, simulated %, analytical %): {rows}")
    assert best_ett - nearest[1] < 0.3  # following the recommendation loses at most 0.3 pp
    assert recommended / 1.6 <= best_interval <= recommended * 1.6
    assert best_ett - rows[-1][1] > 1.0  # and an interval of 1920 s was worth changing


def test_timeline_is_valid_schema_v1_and_numbered_per_source():
    from service.schemas.events import EventBatch

    events = simulate(llama3_405b(days=2), END)
    EventBatch.model_validate({"events": events})
    seqs: dict[tuple, list[int]] = {}
    for e in events:
        seqs.setdefault((e["attempt"], e["source"]), []).append(e["seq"])
    assert all(s == list(range(len(s))) for s in seqs.values())


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_replay_through_a_live_service_reports_what_the_engine_does(service, capsys):
    admin = service.token("admin")
    argv = ["simulate", "--days", "3", "--seed", "7", "--steps-per-event", "30", "--batch", "2000"]
    assert main([*argv, "--service", service.url, "--token", admin, "--json"]) == 0
    out = capsys.readouterr().out
    served = json.loads(out[out.index("{"):])
    model = llama3_405b(days=3, seed=7, steps_per_event=30)
    _, expected = memory_report(model, time.time())
    assert served["state"] == "cancelled"  # a record job: no scheduler ever runs it
    assert served["ett_percent"] == pytest.approx(expected["ett_percent"], abs=1e-6)
    assert served["seconds"] == pytest.approx(expected["seconds"], abs=1e-3)
    assert len(served["failures"]) == len(expected["failures"]) > 0
    assert served["recommended_checkpoint_interval_seconds"] == pytest.approx(
        expected["recommended_checkpoint_interval_seconds"]
    )


def test_bad_model_is_refused_with_the_field_named(capsys):
    assert main(["simulate", "--days", "0"]) == 2
    assert "days must be > 0" in capsys.readouterr().err
