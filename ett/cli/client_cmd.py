"""`ett submit`, `ett jobs`, `ett cancel`, `ett report`: the user's side, over the REST API."""

import argparse
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from ett.cli.render import report_table


def register(sub: argparse._SubParsersAction) -> None:
    def client_parser(name: str, help: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help)
        parser.add_argument("--service", default=os.environ.get("ETT_SERVICE_URL", "http://127.0.0.1:8000"),
                            help="service URL (ETT_SERVICE_URL)")
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
    report.set_defaults(run=run_report)


class SpecFileError(Exception):
    pass


def _line_of(text: str, key: str) -> int | None:
    for number, line in enumerate(text.splitlines(), 1):
        if f'"{key}"' in line or line.strip().startswith((f"{key} ", f"{key}=", f"[{key}")):
            return number
    return None


def load_spec(path: Path) -> dict[str, Any]:
    """Reads and checks a job spec; errors name the file and, where it can be found, the line."""
    from service.schemas.jobs import JobSpec

    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecFileError(f"{path}: {exc.strerror}") from None
    try:
        if path.suffix == ".toml":
            spec = tomllib.loads(text)
        elif path.suffix == ".json":
            spec = json.loads(text)
        else:
            raise SpecFileError(f"{path}: a job spec is a .toml or a .json file")
    except json.JSONDecodeError as exc:
        raise SpecFileError(f"{path}:{exc.lineno}: {exc.msg}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecFileError(f"{path}: {exc}") from None
    try:
        JobSpec.model_validate(spec)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            field = ".".join(str(p) for p in error["loc"]) or "(top level)"
            key = next((str(p) for p in reversed(error["loc"]) if isinstance(p, str)), None)
            line = _line_of(text, key) if key else None
            lines.append(f"{path}:{line or '?'}: {field}: {error['msg']}")
        raise SpecFileError("\n".join(lines)) from None
    return spec


def _client(args: argparse.Namespace) -> httpx.Client:
    if not args.token:
        sys.exit("ett: no token: pass --token or set ETT_TOKEN (an admin creates one with `ett token create`)")
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
        print(f"ett: {exc}", file=sys.stderr)
        return 2
    job = _call(args, "POST", "/api/v1/jobs", json=spec)
    print(job["id"])
    return 0


def run_jobs(args: argparse.Namespace) -> int:
    params = {"state": args.state} if args.state else {}
    jobs = _call(args, "GET", "/api/v1/jobs", params=params)["items"]
    print(f"{'ID':32}  {'NAME':20}  {'STATE':9}  {'ATTEMPTS':>8}  SUBMITTED")
    for job in jobs:
        print(f"{job['id']:32}  {job['name'][:20]:20}  {job['state']:9}  {len(job['attempts']):>8}  "
              f"{job['submitted_at'][:19]}")
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    job = _call(args, "POST", f"/api/v1/jobs/{args.job_id}/cancel")
    print(f"{job['id']} {job['state']}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    report = _call(args, "GET", f"/api/v1/jobs/{args.job_id}/ett")
    print(json.dumps(report, indent=2) if args.json else report_table(report))
    return 0
