"""Slow time with real agents and real torchrun ranks (tests/agent/scripts/paced_rank.py, two
ranks over gloo): a healthy job's seeded jitter, warm-up and every-10th-step work book at most 3%
of its wall time as slow and flag nothing; the same job with every rank twice as slow from step
30 books most of the extra time as slow and reports a slowdown of the whole job, no straggler."""

import pytest

from ett_cli.render import report_table
from tests.service.accounting.test_metrics import scrape
from tests.support.cluster import cluster, events
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow
PACED = ["python", "tests/agent/scripts/paced_rank.py", "--steps", "80", "--step-seconds", "0.1"]


def paced_job(name: str, faults: list[dict]) -> dict:
    return {"name": name, "nodes": 1, "procs_per_node": 2, "entrypoint": PACED, "max_restarts": 0,
            "hang_timeout_seconds": 60, "faults": faults, "warm_imports": ["torch.nn.parallel", "ett.run"]}


@pytest.mark.over_budget("two jobs of 80 real steps each (0.1 s +-25%, the second twice as slow from step 30)")
def test_a_healthy_jobs_noise_is_not_slow_and_every_rank_slower_is_a_whole_job_slowdown(tmp_path):
    slower = [{"attempt": 0, "rank": rank, "at_step": 30, "action": "slow", "factor": 2.0} for rank in (0, 1)]
    with cluster(tmp_path) as c:
        c.start_agents("node-a", slots=4)
        healthy, slowed = c.submit(**paced_job("healthy", [])), c.submit(**paced_job("slowed", slower))
        for job_id in (healthy, slowed):
            assert c.wait_job(job_id)["state"] == "succeeded"
        for job_id in (healthy, slowed):
            wait_for(lambda: c.report(job_id)["last_step"] == 80, 30, "the last step accounted")  # noqa: B023
        report = c.report(healthy)
        assert report["slow_seconds"] <= 0.03 * report["wall_seconds"], report
        assert (report["slowdowns"], report["stragglers"]) == ([], []), report
        report = c.report(slowed)
        steps = {e.step: e.data["duration"] for e in events(c, slowed, "step")}
        extra = sum(d / 2 for s, d in steps.items() if s > 30)  # half of each slowed step's time
        assert report["slow_seconds"] >= 0.6 * extra, (report, extra)
        [slowdown] = report["slowdowns"]
        assert slowdown["cause"] == "whole_job" and 30 <= slowdown["since_step"] <= 40, slowdown
        assert slowdown["factor"] >= 1.5 and report["stragglers"] == [], report
        assert "slowdown (the whole job, attempt 0)" in report_table(report)  # `ett report`
        page = c.user.get(f"/jobs/{slowed}")
        assert page.status_code == 200 and 'data-cause="whole_job"' in page.text
        metrics = scrape(c.user)
        assert metrics[("ett_job_slowdown", frozenset({"job_id": slowed, "job_name": "slowed", "cause": "whole_job"}
                                                      .items()))] == pytest.approx(slowdown["factor"])
        assert not any(name == "ett_job_slowdown" and dict(labels)["job_id"] == healthy for name, labels in metrics)
