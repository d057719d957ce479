"""The user's commands against a real service over HTTP: submit a job file, list, cancel, report;
a job's output and failures shown with their escape sequences escaped; and a one-line error, not a
traceback, from a server that is not ETT."""

import http.server
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tests.deploy.replayed import replayed_job
from tests.service.factories import give_attempt, register_agent, report_failure, submit
from tests.support.cluster import EXAMPLE_JOBS
from tests.support.waiting import wait_for


def ett(*args: str, service: str, token: str | None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "ETT_SERVICE_URL": service, **({"ETT_TOKEN": token} if token else {})}
    return subprocess.run([sys.executable, "-m", "ett_cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_submit_list_cancel_and_report(service):
    token = service.token("user", "alice")
    submitted = ett("submit", str(EXAMPLE_JOBS / "plain_ddp.toml"), service=service.url, token=token)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    # No agent registered: accepted, with a warning that says why it will wait.
    assert submitted.stderr.strip() == ("ett: warning: the job needs 2 nodes with 1 slot each and the fleet has 0 "
                                        "(0 agents registered): it waits in the queue until enough agents register "
                                        "(ett agent)")
    listed = wait_for(lambda: (out := ett("jobs", service=service.url, token=token).stdout) and "waiting for" in out
                      and out, 10, "the waiting reason in `ett jobs`")
    [row] = [line for line in listed.splitlines() if line.startswith(job_id)]
    assert row.split()[1:5] == ["plain-ddp", "queued", "0", "-"]
    assert row.endswith("waiting for 2 nodes with 1 free slot each: the fleet has 0 (0 agents registered); "
                        "start more agents (ett agent)")

    # `ett report --follow` follows the job until it ends: here, until it is cancelled. Into a pipe:
    # the report, then a line per update, then the final report.
    follow = subprocess.Popen([sys.executable, "-m", "ett_cli.main", "report", job_id, "--follow", "--interval", "0.2"],
                              env={"PATH": "/usr/bin:/bin", "ETT_SERVICE_URL": service.url, "ETT_TOKEN": token},
                              stdout=subprocess.PIPE, text=True)
    # Three updates seen (not a sleep: the command's own start-up may take seconds beside the suite).
    seen: list[str] = []
    while sum(re.match(r"\d\d:\d\d:\d\d  queued", line) is not None for line in seen) < 3:
        line = follow.stdout.readline()
        assert line, "".join(seen)  # it ended before the job did
        seen.append(line)
    cancelled = ett("cancel", job_id, service=service.url, token=token)
    rest, _ = follow.communicate(timeout=30)
    out = "".join(seen) + rest
    assert follow.returncode == 0 and out.count(f"job {job_id}") == 2
    assert out[out.rindex(f"job {job_id}"):].startswith(f"job {job_id}  state cancelled")
    lines = out.splitlines()
    first_end = next(i for i, line in enumerate(lines) if line.startswith("recommended checkpoint interval"))
    updates = lines[first_end + 1 : max(i for i, line in enumerate(lines) if line.startswith(f"job {job_id}"))]
    assert len(updates) >= 3 and all(re.fullmatch(r"\d\d:\d\d:\d\d  queued  ETT 0\.0%  wall .*  restarts 0", line)
                                     for line in updates), updates
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"{job_id} cancelled"
    report = ett("report", job_id, "--json", service=service.url, token=token)
    assert report.returncode == 0 and '"state": "cancelled"' in report.stdout
    missing = ett("cancel", "0" * 32, service=service.url, token=token)
    assert missing.returncode == 1 and missing.stderr.strip() == f"ett: the service answered 404: no job {'0' * 32}"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_fleet_prints_the_apis_figures(service):
    job = replayed_job(service, time.time() - 200)
    api = service.client(job.user_token).get("/api/v1/ett").json()
    fleet = ett("fleet", service=service.url, token=job.user_token)
    assert fleet.returncode == 0, fleet.stderr
    assert f"ETT {api['ett_percent']:.1f}%" in fleet.stdout and "failures by cause: exit 1, hang 1" in fleet.stdout
    assert any(line.split()[:2] == [job.id, "moe-pages"] for line in fleet.stdout.splitlines())
    window = ett("fleet", "--since", str(time.time() + 10), service=service.url, token=job.user_token)
    assert window.returncode == 0 and "0 jobs" in window.stdout
    bad = ett("fleet", "--since", "yesterday", service=service.url, token=job.user_token)
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "ett: --since 'yesterday': not a time (ISO 8601 like 2026-11-25T08:00, or unix seconds)")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_report_names_each_failure_and_a_closed_pipe_ends_the_command_quietly(service):
    job = replayed_job(service, time.time() - 200)
    report = ett("report", job.id, service=service.url, token=job.user_token)
    assert report.returncode == 0, report.stderr
    assert re.search(r"^  attempt 0: exit .* lost steps 20  rank 1 exit code 1$", report.stdout, re.M), report.stdout
    # `ett jobs | head -0`: the reader is gone before the first line; no BrokenPipeError traceback.
    read, write = os.pipe()
    os.close(read)
    env = {"PATH": "/usr/bin:/bin", "ETT_SERVICE_URL": service.url, "ETT_TOKEN": job.user_token}
    piped = subprocess.run([sys.executable, "-m", "ett_cli.main", "jobs"], env=env, stdout=write, stderr=subprocess.PIPE,
                           text=True, timeout=60)  # fmt: skip
    os.close(write)
    assert piped.returncode == 141 and piped.stderr == ""


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_logs_and_report_show_what_a_job_printed_with_its_escape_sequences_escaped(service):
    token = service.token("user", "alice")
    job = submit(service.client(token), nodes=8, procs_per_node=1)  # more nodes than registered: left to the test
    agent = service.client(service.token("agent", "node-a"))
    register_agent(agent, "node-a")
    give_attempt(service, job["id"], "node-a")
    # A window title, a cleared screen, colours, a carriage return, a backspace, 8-bit CSI and DEL.
    text = "step 1\tloss 2.3\n\x1b]0;pwned\x07\x1b[2J\x1b[31mred\x1b[0m\r\x08\x9b31m\x7f done\n"
    piece = {"job_id": job["id"], "attempt": 0, "rank": 0, "text": text, "skipped": 0}
    assert agent.post("/api/v1/agents/node-a/logs", json={"logs": [piece]}).status_code == 200
    shown = ett("logs", job["id"], service=service.url, token=token)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == ("step 1\tloss 2.3\n"
                            "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mred\\x1b[0m\\x0d\\x08\\x9b31m\\x7f done\n")
    assert report_failure(agent, "node-a", job["id"], "rank 0 exit code 1 \x1b[2J").is_success
    report = ett("report", job["id"], service=service.url, token=token)
    assert report.returncode == 0 and "rank 0 exit code 1 \\x1b[2J" in report.stdout and "\x1b" not in report.stdout


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
