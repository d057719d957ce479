"""Stragglers with real agents and real torchrun ranks (examples/plain_ddp.py on DDP over gloo),
three jobs at once on seven one-slot agents: a rank slowed 3x (8x) is flagged within 20 steps,
naming its node and rank; with `replace` the job finishes on other nodes without the slow one and
books one `straggler` failure, with `report` on its own nodes with the slow time booked; the
healthy job beside them is never flagged. The load: the other two jobs' processes (and the
suite's other worker) share the 2 cores with the healthy job's. A process spinning on a core
here as well slowed the other worker's tests into timeouts."""

import pytest

from tests.support.cluster import cluster, example_job
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow
SLOW = {"attempt": 0, "rank": 1, "at_step": 10, "action": "slow", "factor": 3.0}


def ddp_job(name: str, steps: int, **spec) -> dict:
    return example_job("plain_ddp.toml", name=name, max_restarts=1,
                       entrypoint=["python", "examples/plain_ddp.py", "--steps", str(steps), "--step-seconds", "0.05"],
                       **spec)  # fmt: skip


def test_a_slow_rank_is_flagged_then_reported_or_replaced_and_a_healthy_job_never(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agents("node-a", "node-b", "node-c", "node-d", "node-e", "node-f", "node-spare")
        # 8x from step 10 of 120: the slowdown would cost about 35 s, far above a restart (the rule
        # weighs the attempt's own start-up, which load stretches: 4x over 100 steps, about 12 s,
        # did not tip it in CI with the suite's other worker busy; and the others start once it has
        # stepped: six ranks importing torch at once on 2 cores stretch a start-up too).
        replaced = c.submit(**ddp_job("replace", 120, faults=[SLOW | {"factor": 8.0}], stragglers="replace"))
        wait_for(lambda: c.report(replaced)["last_step"], 120, "the replace job's first step")
        reported = c.submit(**ddp_job("reported", 30, faults=[SLOW]))
        healthy = c.submit(**ddp_job("healthy", 30))

        def straggler_series() -> str | None:
            lines = c.service.client().get("/metrics").text.splitlines()
            series = (line for line in lines if line.startswith("ett_job_straggler{") and reported in line)
            return next(series, None)

        exported = wait_for(straggler_series, 120, "the reported job's flagged rank in the metrics")
        assert 'rank="1"' in exported, exported
        jobs = {job_id: c.wait_job(job_id) for job_id in (replaced, reported, healthy)}
        assert all(job["state"] == "succeeded" for job in jobs.values()), jobs

        job, report = jobs[replaced], c.report(replaced)
        slow_node = job["attempts"][0]["nodes"][1]
        # The slowed rank's flag. In one CI run a report held a second flag, whether of this job's
        # healthy attempt 1 or of the reported job's rank 0 was not kept: see BENCHMARKS.md.
        [flag] = [f for f in report["stragglers"] if (f["attempt"], f["rank"]) == (0, 1)]
        assert (flag["rank"], flag["node"], flag["action"]) == (1, slow_node, "replaced")
        assert 10 <= flag["since_step"] and flag["flagged_step"] <= 10 + 20 and flag["relative"] >= 1.5, flag
        assert [a["cause"] for a in job["attempts"]] == ["straggler", None]
        assert slow_node not in job["attempts"][1]["nodes"] and len(job["attempts"][1]["nodes"]) == 2
        assert [f["cause"] for f in report["failures"]] == ["straggler"]
        assert report["failures"][0]["lost_steps"] == 0  # the stop saved the step it stopped at
        assert report["slow_seconds"] > 0 and report["full_speed_percent"] < report["ett_percent"]
        [node] = [n for n in c.admin.get("/api/v1/nodes").json() if n["name"] == slow_node]
        assert (node["flags"], node["failures"]) == (1, 1), node  # `ett nodes` shows both

        job, report = jobs[reported], c.report(reported)
        print("flags:", c.report(replaced)["stragglers"], report["stragglers"])  # kept in the log on a failure
        [flag] = [f for f in report["stragglers"] if (f["attempt"], f["rank"]) == (0, 1)]
        assert (flag["rank"], flag["node"], flag["action"]) == (1, job["attempts"][0]["nodes"][1], "reported")
        assert flag["flagged_step"] <= 30 and len(job["attempts"]) == 1 and report["failures"] == []
        assert report["slow_seconds"] > 0.2 * (report["seconds"]["productive"] / 2)  # 20 of 30 steps 3x slower

        quiet = c.report(healthy)
        assert quiet["stragglers"] == [], quiet["stragglers"]
