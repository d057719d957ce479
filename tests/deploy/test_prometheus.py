"""Prometheus config and rules pass promtool; every metric the dashboard and the alerts name is
exported; a real Prometheus scraping a live service reads the job's ETT ratio the API reports."""

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.node.metrics import AgentStats, StatsCollector
from tests.deploy.replayed import replayed_job
from tests.deploy.servers import prometheus, tool
from tests.support.waiting import wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def promtool(*args: str | Path) -> None:
    result = subprocess.run([tool("promtool"), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_config_and_the_rules():
    promtool("check", "config", DEPLOY / "prometheus" / "prometheus.yml")
    promtool("check", "rules", ALERTS)


def test_each_alert_fires_on_its_case_and_not_beside_it():
    cases = Path(__file__).with_name("alerts_test.yml")
    promtool("test", "rules", cases)
    tested = {t["alertname"] for case in yaml.safe_load(cases.read_text())["tests"] for t in case["alert_rule_test"]}
    rules = {r["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for r in group["rules"]}
    assert tested == rules, "every alert rule has its case in alerts_test.yml"


def queries() -> list[str]:
    """Every PromQL expression of the dashboard (panels and variables) and of the alert rules."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "ett.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    rules = yaml.safe_load(ALERTS.read_text())
    return exprs + [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    # Our metrics all start with ett_ (label values like "ett-agent" do not match); `up` is Prometheus's.
    return set(re.findall(r"\bett_[a-z0-9_]+\b", expr)) | ({"up"} if re.search(r"\bup\{", expr) else set())


def exported(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it was exported with."""
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    return samples


@SQLITE_ONLY
def test_every_metric_of_the_dashboard_and_the_alerts_is_exported(service):
    job = replayed_job(service, time.time() - 200)
    from_service = exported(service.client().get("/metrics").text)
    registry = CollectorRegistry()
    registry.register(StatsCollector(AgentStats()))
    from_agent = exported(generate_latest(registry).decode())
    named = set().union(*map(metric_names, queries()))
    assert {"ett_job_ett_ratio", "ett_job_seconds", "ett_job_checkpoint_blocking_seconds_bucket", "up"} <= named
    for name in sorted(named - {"up"}):
        if name.startswith("ett_agent_"):
            assert name in from_agent, f"{name} is not among the agent's metrics"
        elif name == "ett_job_straggler":  # a series only while a rank is flagged: tests/e2e/recovery/test_stragglers.py
            continue
        elif name.startswith("ett_job_"):
            labels = from_service.get(name, [])
            assert any(ls.get("job_id") == job.id for ls in labels), f"{name} is not exported for a job with events"
        else:
            assert name in from_service, f"{name} is not among the service's metrics"


def test_failed_checkpoint_saves_are_counted_per_job(service):
    job = replayed_job(service, time.time() - 200)
    samples = {
        s.labels["job_id"]: s.value
        for family in text_string_to_metric_families(service.client().get("/metrics").text)
        for s in family.samples
        if s.name == "ett_job_checkpoints_failed_total"
    }
    assert samples == {job.id: 1.0}  # attempt 1's save of step 55


@SQLITE_ONLY
def test_real_prometheus_reads_the_ett_ratio_the_api_reports(service, tmp_path):
    job = replayed_job(service, time.time() - 200)
    api = service.client(job.user_token).get(f"/api/v1/jobs/{job.id}/ett").json()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],  # the deployment's rules, evaluated on real series
        "scrape_configs": [{"job_name": "ett-service", "static_configs": [{"targets": [service.url.split("//")[1]]}]}],
    }
    with prometheus(config, tmp_path) as url:
        query = f'ett_job_ett_ratio{{job_id="{job.id}", job="ett-service"}}'

        def ratio():
            result = httpx.get(f"{url}/api/v1/query", params={"query": query}).json()["data"]["result"]
            return result and float(result[0]["value"][1])

        assert wait_for(ratio, 30, "the first scrape", interval=0.2) == pytest.approx(api["ett_percent"] / 100, rel=1e-12)

        def evaluated_rules():
            groups = httpx.get(f"{url}/api/v1/rules").json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if all(r["health"] != "unknown" for r in rules) else None

        rules = wait_for(evaluated_rules, 30, "the alert rules' first evaluation", interval=0.2)
        assert len(rules) == sum(len(g["rules"]) for g in yaml.safe_load(ALERTS.read_text())["groups"])
        assert {r["name"]: r["health"] for r in rules} == {r["name"]: "ok" for r in rules}
