"""Checkpoint tiers and adaptive hang detection in the simulator (`ett simulate --tiers`,
`--from-job`): snapshots restore what a failure that keeps its nodes would lose, a lost node's
only from its peers' copies (replicated), and the side-by-side projection of a measured job."""

import time

from ett_cli.main import main
from service.accounting.simulate import llama3_405b, memory_report, recommended_tiers, tier_models

END = 1.9e9


def failures_by_cause(events: list[dict]) -> dict[int, str]:
    return {e["attempt"]: e["data"]["cause"] for e in events if e["kind"] == "attempt_failed"}


def test_a_failure_that_keeps_its_nodes_resumes_from_the_newest_snapshot_and_a_lost_node_never_does():
    # Snapshots every step event (1 min), persistent checkpoints every 30 min.
    model = llama3_405b(days=20, local_interval_seconds=60, local_blocking_seconds=1.0)
    events, report = memory_report(model, END)
    causes = failures_by_cause(events)
    restores = {e["attempt"]: e for e in events if e["kind"] == "restore_end"}
    committed_before: dict[int, int] = {}
    newest = 0
    for e in events:
        if e["kind"] == "ckpt_committed":
            newest = max(newest, e["step"])
        if e["kind"] == "attempt_allocated":
            committed_before[e["attempt"]] = newest
    assert {c for c in causes.values()} >= {"exit", "node_lost"}
    for attempt, restore in restores.items():
        if causes.get(attempt - 1) == "node_lost":
            assert restore["data"]["source"] == "persistent" and restore["step"] == committed_before[attempt]
    local = [r for r in restores.values() if r["data"]["source"] == "local-snapshot"]
    assert local and all(r["step"] >= committed_before[r["attempt"]] for r in local)
    # Resumed from a snapshot, a failure loses at most the steps of one snapshot interval.
    for failure in report["failures"]:
        if restores.get(failure["attempt"] + 1, {}).get("data", {}).get("source") == "local-snapshot":
            assert failure["lost_steps"] <= model.blocks_per_snapshot * model.steps_per_event


def test_adaptive_detection_catches_a_hang_in_four_steps_not_the_hang_timeout():
    assert llama3_405b().detection_seconds("hang") == 120
    assert llama3_405b(adaptive_detection=True).detection_seconds("hang") == 40  # 4 steps of 10 s
    assert llama3_405b(adaptive_detection=True, step_seconds=0.5).detection_seconds("hang") == 3  # the floor


def test_two_tiers_beat_one_on_the_llama3_405b_scenario():
    model = llama3_405b()
    local, persistent = recommended_tiers(model)
    assert local < persistent
    runs = {label: memory_report(m, END)[1] for label, m in tier_models(model).items()}
    one, two = runs["persistent only"], runs["local"]
    assert len(one["failures"]) > 300 and len(two["failures"]) > 300
    mean_lost = lambda r: sum(f["lost_steps"] for f in r["failures"]) / len(r["failures"])  # noqa: E731
    assert mean_lost(two) < mean_lost(one) * 0.75
    # A failure that keeps its nodes loses at most one snapshot interval of steps, unless the
    # next attempt loses a node before it restores (then the persistent tier's rollback is its).
    snapshot_steps = tier_models(model)["local"].blocks_per_snapshot * model.steps_per_event
    kept_nodes = [f["lost_steps"] for f in two["failures"] if f["cause"] != "node_lost" and f["lost_steps"] is not None]
    assert sum(lost <= snapshot_steps for lost in kept_nodes) >= 0.97 * len(kept_nodes) > 0
    assert two["ett_percent"] > one["ett_percent"] + 2.0, (one["ett_percent"], two["ett_percent"])


def test_replicated_snapshots_make_a_node_loss_lose_as_little_as_any_other_failure():
    model = llama3_405b()
    runs = {label: memory_report(m, END) for label, m in tier_models(model).items()}
    (events, replicated), (_, local) = runs["local replicated"], runs["local"]
    node_losses = lambda r: [f["lost_steps"] for f in r["failures"] if f["cause"] == "node_lost"]  # noqa: E731
    assert len(node_losses(replicated)) == len(node_losses(local)) > 50  # the same failure times
    snapshot_steps = tier_models(model)["local replicated"].blocks_per_snapshot * model.steps_per_event
    lost = [s for s in node_losses(replicated) if s is not None]
    assert sum(s <= snapshot_steps for s in lost) >= 0.97 * len(lost)  # as a failure that keeps its nodes
    assert sum(lost) / len(lost) < 0.1 * sum(s for s in node_losses(local) if s) / len(node_losses(local))
    causes = failures_by_cause(events)
    sources = {e["attempt"]: e["data"]["source"] for e in events if e["kind"] == "restore_end"}
    assert {sources[a + 1] for a, c in causes.items() if c == "node_lost" and a + 1 in sources} >= {"peer-snapshot"}
    assert replicated["ett_percent"] > local["ett_percent"] + 1.0, (local["ett_percent"], replicated["ett_percent"])


def test_ett_simulate_tiers_prints_the_three_tiers(capsys):
    assert main(["simulate", "--tiers", "--days", "10"]) == 0
    out = capsys.readouterr().out
    assert "persistent only" in out and "local replicated" in out and "ETT (simulated)" in out


def test_from_job_projects_a_measured_jobs_costs(service, capsys):
    """A job's report from a live service: its measured costs go into the projection."""
    client = service.client(service.token("admin"))
    job = client.post("/api/v1/jobs", json={"name": "measured", "nodes": 1}).json()
    t = time.time() - 100
    events = [
        {"kind": "attempt_allocated", "ts": t, "attempt": 0, "source": "service", "seq": 0, "data": {"nodes": ["a"]}},
        {"kind": "init_start", "ts": t + 1, "attempt": 0, "source": "rank:0", "seq": 0, "data": {}},
        {"kind": "init_end", "ts": t + 4, "attempt": 0, "source": "rank:0", "seq": 1, "data": {}},
    ] + [{"kind": "step", "ts": t + 4 + 2 * s, "attempt": 0, "source": "rank:0", "seq": 1 + s, "step": s,
          "data": {"duration": 2.0}} for s in range(1, 11)]  # fmt: skip
    assert client.post(f"/api/v1/jobs/{job['id']}/events", json={"events": events}).status_code == 200
    code = main(["simulate", "--from-job", job["id"], "--service", service.url, "--token", service.token("admin"),
                 "--days", "5"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "init_seconds 4" in out and "step_seconds 2" in out  # allocation to the first step; the mean step
    assert "local replicated" in out


def test_from_job_without_a_service_is_refused(capsys):
    assert main(["simulate", "--from-job", "abc", "--token", "x"]) == 2
    assert "--from-job needs --service" in capsys.readouterr().err
