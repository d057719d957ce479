"""/metrics over real HTTP: ETT series computed from the database at scrape time (the same from
any service process), bounded to running and recent jobs, and the service's own request series."""

import re
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service.accounting.test_engine_timelines import crash_with_rollback
from tests.service.factories import submit
from tests.support.live import live_service


def scrape(client) -> dict[tuple[str, frozenset], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


FLAGGED_ONLY = {"ett_job_straggler", "ett_job_slowdown"}  # series only while flagged or slowed


def documented_metrics() -> set[str]:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "ett.md").read_text()
    return set(re.findall(r"^\| `(ett_[a-z_]+)` \|", doc, re.M))


def test_job_series_come_from_the_database_whichever_app_serves_them(service, settings):
    admin = service.client(service.token("admin"))
    alice = service.client(service.token("user", "alice"))
    recent, old = submit(alice, name="recent", nodes=8), submit(alice, name="old", nodes=8)
    for job, t0 in ((recent, time.time() - 120), (old, 1_700_000_000.0)):
        events = [asdict(e) for e in crash_with_rollback(t0).events]
        admin.post(f"/api/v1/jobs/{job['id']}/events", json={"events": events}).raise_for_status()
    labels = {"job_id": recent["id"], "job_name": "recent"}

    def series(samples, name, **extra):
        return samples[(name, frozenset((labels | extra).items()))]

    # A second app on the same database, in this same process (its own engine, registry and
    # collector; no state shared with the first): it answers with the same figures.
    with live_service(settings) as other:
        for samples in (scrape(service.client()), scrape(other.client())):
            assert series(samples, "ett_job_ett_ratio") == pytest.approx(24 / 58)
            assert series(samples, "ett_job_wall_seconds") == pytest.approx(58)
            assert series(samples, "ett_job_seconds", category="wasted") == pytest.approx(6)
            assert series(samples, "ett_job_seconds", category="recovery") == pytest.approx(6.5)
            assert series(samples, "ett_job_failures_total") == 1
            assert series(samples, "ett_job_restarts_total") == 1
            assert series(samples, "ett_job_time_to_start_seconds") == pytest.approx(10)
            assert series(samples, "ett_job_time_to_recover_seconds") == pytest.approx(14.5)
            assert series(samples, "ett_job_step_seconds") == pytest.approx(3)
            assert series(samples, "ett_job_checkpoint_blocking_seconds_count") == 2
            assert series(samples, "ett_job_checkpoint_blocking_seconds_sum") == pytest.approx(1.0)
            assert series(samples, "ett_job_checkpoint_blocking_seconds_bucket", le="0.5") == 2
            assert series(samples, "ett_job_checkpoint_blocking_seconds_bucket", le="0.25") == 0
            assert samples[("ett_fleet_ett_ratio", frozenset())] == pytest.approx(24 / 58)
            assert samples[("ett_jobs", frozenset({("state", "queued")}))] == 2
            # The job that finished long ago has no per-job series.
            assert not any(dict(k[1]).get("job_id") == old["id"] for k in samples)
        # Every series is documented for the dashboards, and every documented one is served
        # (by the first process, which has served requests by now).
        names = [name for name, _ in scrape(service.client()) if not name.endswith("_created")]
        # ett_job_straggler has a series only while a rank is flagged (tests/e2e/recovery/test_stragglers.py scrapes one).
        assert {re.sub(r"_(bucket|sum|count)$", "", name) for name in names} == documented_metrics() - FLAGGED_ONLY


def test_request_series_by_route_template(service):
    client = service.client(service.token("user", "alice"))
    job = submit(client, nodes=8)
    assert client.get(f"/api/v1/jobs/{job['id']}/ett").status_code == 200
    assert client.get("/api/v1/jobs/nope/ett").status_code == 404
    client.get("/no/such/path")
    samples = scrape(client)

    def requests(route, status, method="GET"):
        key = frozenset({"method": method, "route": route, "status": status}.items())
        return samples.get(("ett_http_requests_total", key), 0)

    assert requests("/api/v1/jobs/{job_id}/ett", "200") == 1
    assert requests("/api/v1/jobs/{job_id}/ett", "404") == 1
    assert requests("/api/v1/jobs", "201", "POST") == 1
    assert requests("unmatched", "404") == 1
    duration = frozenset({"method": "GET", "route": "/api/v1/jobs/{job_id}/ett"}.items())
    assert samples[("ett_http_request_duration_seconds_count", duration)] == 2
