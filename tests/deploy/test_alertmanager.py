"""Alertmanager (deploy/alertmanager/alertmanager.yml) routes ETT's alerts to its webhook: amtool
accepts the file, and a real Prometheus scraping a real ETT service, with the deployment's rules,
fires on a failing job and Debian's real Alertmanager delivers that alert to a receiver."""

import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.servers import alertmanager, prometheus, tool
from tests.service.accounting.timelines import Timeline
from tests.service.factories import submit
from tests.support.waiting import wait_for
from tests.support.webhook import webhook_receiver

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"


def test_amtool_accepts_the_config():
    result = subprocess.run([tool("amtool"), "check-config", str(CONFIG)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def for_the_test(receiver_url: str) -> dict:
    """The deployment's config with only the webhook's URL and the waits made the test's."""
    config = yaml.safe_load(CONFIG.read_text())
    [receiver] = config["receivers"]
    [webhook] = receiver["webhook_configs"]
    webhook["url"] = f"{receiver_url}/alerts"
    config["route"] |= {"group_wait": "1s", "group_interval": "1s"}
    return config


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_failing_job_fires_and_alertmanager_delivers_it_to_the_webhook(service, tmp_path):
    admin, user = service.token("admin"), service.token("user", "alice")
    job = submit(service.client(user), name="moe-failing", nodes=8)  # more nodes than exist: replayed only
    tl = Timeline(time.time() - 30)
    tl.start_attempt(0, allocated=0, init_end=2)
    tl.steps(0, 1, 20, start=2, duration=1)
    tl.service("attempt_failed", 23, 0, cause="exit", detail="rank 1 exit code 1")
    *running, failed = [asdict(e) for e in tl.events]

    def replay(events: list[dict]) -> None:
        response = service.client(admin).post(f"/api/v1/jobs/{job['id']}/events", json={"events": events})
        assert response.status_code == 200, response.text

    replay(running)
    with webhook_receiver() as receiver, alertmanager(for_the_test(receiver.url), tmp_path) as am_url:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am_url.split("//")[1]]}]}]},
            "scrape_configs": [{"job_name": "ett-service",
                                "static_configs": [{"targets": [service.url.split("//")[1]]}]}],
        }  # fmt: skip
        with prometheus(config, tmp_path) as url:
            query = f'ett_job_failures_total{{job_id="{job["id"]}"}}'

            def failures() -> list:
                return httpx.get(f"{url}/api/v1/query", params={"query": query}).json()["data"]["result"]

            assert wait_for(failures, 30, "the first scrape", interval=0.2)[0]["value"][1] == "0"
            replay([failed])  # the attempt fails while Prometheus watches

            def delivered() -> list[dict]:
                return [alert for d in receiver.at("/alerts") for alert in d.json()["alerts"]
                        if alert["labels"]["alertname"] == "EttJobAttemptFailed"]

            [alert] = wait_for(delivered, 60, "the alert at the webhook", interval=0.2)
    assert alert["status"] == "firing"
    assert alert["labels"] | {"job_id": job["id"]} == alert["labels"]  # the failing job's
    assert (alert["labels"]["job_name"], alert["labels"]["severity"]) == ("moe-failing", "warning")
    assert alert["annotations"]["summary"] == "Job moe-failing: an attempt failed"
