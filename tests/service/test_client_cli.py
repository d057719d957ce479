"""The user's commands against a real service over HTTP: submit a job file, list, cancel, report;
and a one-line error, not a traceback, from a server that is not ETT."""

import http.server
import subprocess
import sys
import threading

import pytest

from tests.support.cluster import EXAMPLE_JOBS


def ett(*args: str, service: str, token: str | None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "ETT_SERVICE_URL": service, **({"ETT_TOKEN": token} if token else {})}
    return subprocess.run([sys.executable, "-m", "ett.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_submit_list_cancel_and_report(service):
    token = service.token("user", "alice")
    submitted = ett("submit", str(EXAMPLE_JOBS / "plain_ddp.toml"), service=service.url, token=token)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    listed = ett("jobs", service=service.url, token=token)
    assert job_id in listed.stdout and "plain-ddp" in listed.stdout and "queued" in listed.stdout
    cancelled = ett("cancel", job_id, service=service.url, token=token)
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"{job_id} cancelled"
    report = ett("report", job_id, "--json", service=service.url, token=token)
    assert report.returncode == 0 and '"state": "cancelled"' in report.stdout
    missing = ett("cancel", "0" * 32, service=service.url, token=token)
    assert missing.returncode == 1 and missing.stderr.strip() == f"ett: the service answered 404: no job {'0' * 32}"


def test_a_server_that_is_not_ett_gets_one_line_not_a_traceback():
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        result = ett("jobs", service=url, token="ett_x")
    finally:
        server.shutdown()
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith(f"ett: {url} answered GET /api/v1/jobs with HTTP 404")
    assert result.stderr.strip().endswith("not an ETT service's JSON: check --service (ETT_SERVICE_URL)")
