"""The straggler simulator (service/accounting/simulate_stragglers.py, `ett simulate --stragglers`)."""

import pytest

from ett_cli.main import main
from service.accounting.simulate_stragglers import StragglerModel, simulate_stragglers, straggler_sweep


def test_replacing_pays_for_long_large_slowdowns_and_loses_for_short_ones():
    long_large = StragglerModel(days=10, slowdown_median=2.0, lasting_hours=12)
    report, replace = (simulate_stragglers(long_large, p) for p in ("report", "replace"))
    assert replace.full_speed_percent > report.full_speed_percent + 20 and replace.replaced > 0
    assert report.replaced == 0 and report.restart_seconds == 0
    short = StragglerModel(days=10, slowdown_median=1.3, lasting_hours=0.1)
    replaced, reported = (simulate_stragglers(short, p).full_speed_percent for p in ("replace", "report"))
    assert replaced < reported


def test_a_slowdown_under_the_flag_threshold_is_never_replaced_and_a_seed_repeats():
    tiny = StragglerModel(days=10, slowdown_median=1.02, slowdown_sigma=0.0)
    assert simulate_stragglers(tiny, "replace").replaced == 0
    model = StragglerModel(days=5)
    assert simulate_stragglers(model, "replace") == simulate_stragglers(model, "replace")
    none = StragglerModel(days=5, rate_per_node_day=1e-9)
    assert simulate_stragglers(none, "report").full_speed_percent == pytest.approx(100.0)


def test_the_sweep_and_the_command(capsys):
    rows = straggler_sweep(StragglerModel(days=2), medians=(1.05, 2.0), lasting=(1.0,))
    assert [(median, hours) for median, hours, _, _ in rows] == [(1.05, 1.0), (2.0, 1.0)]
    assert main(["simulate", "--stragglers", "--days", "2"]) == 0
    out = capsys.readouterr().out
    assert "16,384 GPUs" in out and out.count("%") >= 30
