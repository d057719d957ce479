"""`ett submit`, `ett jobs`, `ett cancel`, `ett report`, `ett logs`, `ett nodes`, `ett fleet`: the users' and
operators' side, over the REST API."""

import argparse
import itertools
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from ett.protocol import service_url
from ett_cli.render import fleet_table, progress_line, report_table, terminal_safe
from ett_cli.spec_file import SpecFileError, load_spec

TERMINAL = ("succeeded", "failed", "cancelled")


def register(sub: argparse._SubParsersAction) -> None:
    def client_parser(name: str, help: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help)
        parser.add_argument("--service", help="service URL (ETT_SERVICE_URL; default: this machine's, "
                                              "http://127.0.0.1:ETT_PORT, 8000 without ETT_PORT)")
        parser.add_argument("--token", default=os.environ.get("ETT_TOKEN"), help="bearer token (ETT_TOKEN)")
        return parser

    submit = client_parser("submit", "submit a job from a .toml or .json spec")
    submit.add_argument("file", type=Path)
    submit.set_defaults(run=run_submit)
    jobs = client_parser("jobs", "list jobs")
    jobs.add_argument("--state", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    jobs.set_defaults(run=run_jobs)
    cancel = client_parser("cancel", "cancel a job: its ranks are stopped, and it is not restarted")
    cancel.add_argument("job_id")
    cancel.set_defaults(run=run_cancel)
    report = client_parser("report", "print a job's ETT report")
    report.add_argument("job_id")
    report.add_argument("--json", action="store_true", help="the raw report of GET /api/v1/jobs/{id}/ett")
    report.add_argument("--follow", action="store_true",
                        help="print it again every --interval seconds until the job ends (into a pipe or "
                             "file: the report, then one line per update, then the final report)")
    report.add_argument("--interval", type=float, default=5.0, help="seconds between reports with --follow")
    report.set_defaults(run=run_report)
    logs = client_parser("logs", "print a rank's output (default: the newest attempt's failed rank, else rank 0)")
    logs.add_argument("job_id")
    logs.add_argument("--attempt", type=int, help="attempt number (default: the newest)")
    logs.add_argument("--rank", type=int, help="global rank (default: the one the attempt's failure names, else 0)")
    logs.add_argument("--tail", type=int, default=None, help="only the last N lines")
    logs.add_argument("--follow", action="store_true", help="keep printing what the rank prints until the job ends")
    logs.add_argument("--interval", type=float, default=1.0, help="seconds between reads with --follow")
    logs.set_defaults(run=run_logs)
    nodes = client_parser("nodes", "the nodes (admin): state, health, drain, jobs, recent failures and straggler "
                                   "flags; `ett nodes drain NAME` keeps new work off one, `ett nodes return NAME` "
                                   "gives it back")
    nodes.add_argument("action", nargs="?", choices=["drain", "return"])
    nodes.add_argument("name", nargs="?", help="the node to drain or return")
    nodes.add_argument("--reason", help="why it is drained (shown in `ett nodes`)")
    nodes.set_defaults(run=run_nodes)
    fleet = client_parser("fleet", "print the fleet's ETT over a window (your jobs; every job for an admin)")
    fleet.add_argument("--since", help="window start: ISO 8601 (UTC if no zone) or unix seconds (default: all time)")
    fleet.add_argument("--until", help="window end (default: now)")
    fleet.add_argument("--json", action="store_true", help="the raw report of GET /api/v1/ett")
    fleet.set_defaults(run=run_fleet)


def _client(args: argparse.Namespace) -> httpx.Client:
    if not args.token:
        sys.exit("ett: no token: pass --token or set ETT_TOKEN (an admin creates one with `ett token create`)")
    if args.service is None:  # read here, not at parsing: a bad ETT_PORT fails only the commands that call
        try:
            args.service = service_url(os.environ)
        except ValueError as exc:
            sys.exit(f"ett: {exc}")
    return httpx.Client(base_url=args.service, headers={"Authorization": f"Bearer {args.token}"}, timeout=30)


def _call(args: argparse.Namespace, method: str, path: str, **kwargs: Any) -> Any:
    try:
        with _client(args) as client:
            response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        sys.exit(f"ett: cannot reach the service at {args.service}: {exc}")
    try:
        body = response.json()
    except ValueError:  # not JSON: not an ETT service (a proxy's error page, another server)
        kind = response.headers.get("content-type", "no content type")
        sys.exit(f"ett: {args.service} answered {method} {path} with HTTP {response.status_code} and {kind}, "
                 "not an ETT service's JSON: check --service (ETT_SERVICE_URL)")
    if response.is_error:
        detail = body.get("detail") if isinstance(body, dict) else body
        sys.exit(f"ett: the service answered {response.status_code}: {detail}")
    return body


def run_submit(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.file)
    except SpecFileError as exc:
        for line in str(exc).splitlines():
            print(f"ett: {line}", file=sys.stderr)
        return 2
    job = _call(args, "POST", "/api/v1/jobs", json=spec)
    for warning in job.get("warnings", []):
        print(f"ett: warning: {warning}", file=sys.stderr)
    print(job["id"])
    return 0


def run_jobs(args: argparse.Namespace) -> int:
    params = {"state": args.state} if args.state else {}
    jobs = _call(args, "GET", "/api/v1/jobs", params=params)["items"]
    print(f"{'ID':32}  {'NAME':20}  {'STATE':9}  {'ATTEMPTS':>8}  {'ETT':>6}  {'SUBMITTED (UTC)':19}  REASON")
    for job in jobs:
        ett = "-"
        if job["state"] != "queued":
            ett = f"{_call(args, 'GET', '/api/v1/jobs/' + job['id'] + '/ett')['ett_percent']:.1f}%"
        print(f"{job['id']:32}  {job['name'][:20]:20}  {job['state']:9}  {len(job['attempts']):>8}  {ett:>6}  "
              f"{job['submitted_at'][:19]:19}  {terminal_safe(job['reason'] or '')}")
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    job = _call(args, "POST", f"/api/v1/jobs/{args.job_id}/cancel")
    print(f"{job['id']} {job['state']}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    # A terminal is read by a person: the whole report each time. A pipe or a file is kept: the
    # report once, a line per update, the final report (--json: one compact report per line).
    terse = args.follow and not sys.stdout.isatty()
    for number in itertools.count():
        report = _call(args, "GET", f"/api/v1/jobs/{args.job_id}/ett")
        done = not args.follow or report["state"] in TERMINAL
        if args.json:
            print(json.dumps(report) if terse else json.dumps(report, indent=2), flush=True)
        elif terse and number and not done:
            print(progress_line(report), flush=True)
        else:
            # A failure's detail and summary are what the job printed: escaped like its logs.
            print(("\n" if number and not terse else "") + terminal_safe(report_table(report)), flush=True)
        if done:
            return 0
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 130
    return 0


def run_logs(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {k: v for k, v in (("attempt", args.attempt), ("rank", args.rank), ("tail", args.tail))
                              if v is not None}
    log = _call(args, "GET", f"/api/v1/jobs/{args.job_id}/logs", params=params)
    if not args.follow and log["node"] is None:
        ranks = ", ".join(map(str, log["ranks"])) or "none yet"
        print(f"ett: rank {log['rank']} of attempt {log['attempt']} printed nothing (ranks with output: {ranks})",
              file=sys.stderr)
    # What the job printed, its escape sequences shown, not obeyed (`\x1b`): it cannot drive the terminal.
    print(terminal_safe(log["text"]), end="", flush=True)
    params |= {"attempt": log["attempt"], "rank": log["rank"]}
    params.pop("tail", None)
    while args.follow:
        if _call(args, "GET", f"/api/v1/jobs/{args.job_id}")["state"] in TERMINAL:
            args.follow = False  # one last read: what came in before the end
        try:
            time.sleep(args.interval if args.follow else 0)
        except KeyboardInterrupt:
            return 130
        log = _call(args, "GET", f"/api/v1/jobs/{args.job_id}/logs", params=params | {"since": log["end"]})
        print(terminal_safe(log["text"]), end="", flush=True)
    return 0


def run_nodes(args: argparse.Namespace) -> int:
    if args.action is not None:
        if not args.name:
            print(f"ett: `ett nodes {args.action}` needs the node's name", file=sys.stderr)
            return 2
        body = {"reason": args.reason} if args.action == "drain" else None
        node = _call(args, "POST", f"/api/v1/nodes/{args.name}/{args.action}", json=body)
        print(f"{node['name']}: {node['drained'] or 'returned: it takes new work'}")
        return 0
    print(f"{'NAME':24}  {'STATE':8}  {'SLOTS':>5}  {'FAILURES':>8}  {'FLAGS':>5}  {'EVIDENCE':>8}  {'JOBS':32}  "
          "WHY NO NEW WORK")
    for node in _call(args, "GET", "/api/v1/nodes"):
        why = "; ".join(filter(None, (node["drained"], node["health"])))
        print(f"{node['name'][:24]:24}  {node['state']:8}  {node['slots']:>5}  {node['failures']:>8}  "
              f"{node.get('flags', 0):>5}  {node.get('evidence_count', 0):>8}  {','.join(node['jobs'])[:32]:32}  "
              f"{terminal_safe(why)}")
        if node.get("slow"):  # stragglers of several jobs on it: the node, not one job's data
            print("    " + terminal_safe(node["slow"]))
        for evidence in node.get("evidence", []):  # what tells of the node itself, and drains it
            print("    " + terminal_safe(evidence_line(evidence)))
    return 0


def evidence_line(evidence: dict) -> str:
    """One piece of a node's evidence as `ett nodes` shows it under the node."""
    attempt = f", job {evidence['job_id']} attempt {evidence['attempt']}" if evidence.get("job_id") else ""
    counted = " [drained it]" if evidence.get("drained") else ""
    return (f"{evidence['seen_at'][:19]}  {evidence['kind']} from {evidence['source']}{attempt}: "
            f"{evidence['detail']}{counted}")


def _moment(text: str | None, flag: str) -> str | None:
    """ISO 8601 or unix seconds, as the service takes them; a one-line error naming the flag."""
    if text is None:
        return None
    try:
        float(text)
        return text
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).isoformat()
    except ValueError:
        sys.exit(f"ett: {flag} {text!r}: not a time (ISO 8601 like 2026-11-25T08:00, or unix seconds)")


def run_fleet(args: argparse.Namespace) -> int:
    window = {"since": _moment(args.since, "--since"), "until": _moment(args.until, "--until")}
    fleet = _call(args, "GET", "/api/v1/ett", params={k: v for k, v in window.items() if v is not None})
    print(json.dumps(fleet, indent=2) if args.json else fleet_table(fleet))
    return 0
