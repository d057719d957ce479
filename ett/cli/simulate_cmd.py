"""`ett simulate`: a large job's timeline from a failure model, its ETT report, in memory or
replayed through a running service's admin events endpoint."""

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import httpx

from ett.cli.render import report_table
from service.ett.simulate import FleetModel, expected_ett, memory_report, simulate, sweep, young_interval_seconds

HELP = {
    "nodes": "nodes of the job",
    "gpus_per_node": "GPUs (ranks) per node",
    "days": "wall time simulated",
    "mtbf_seconds": "the job's mean time between failures (default: 54 days / 419 interruptions)",
    "step_seconds": "length of one training step",
    "steps_per_event": "real steps aggregated into one step event",
    "checkpoint_interval_seconds": "training time between checkpoints (rounded to whole step events)",
    "checkpoint_blocking_seconds": "blocking part of a save (ckpt_start -> ckpt_staged)",
    "checkpoint_write_seconds": "asynchronous rest of a save (ckpt_staged -> ckpt_committed)",
    "init_seconds": "start-up of an attempt (allocation -> init_end)",
    "restore_seconds": "loading the newest committed checkpoint",
    "reschedule_seconds": "from a failure's detection to the next allocation",
    "seed": "random seed of the failure times",
}
SWEEP_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "simulate", help="simulate a large job under failures and print its ETT report",
        description="Generates a job's schema-v1 timeline from a Poisson failure model at simulated time "
        "(default: Llama 3 405B, 2,048 nodes x 8 GPUs, 54 days, 419 interruptions) and prints the ETT "
        "report: of the pure engine in memory, or, with --service, of a running service after replaying "
        "the timeline through POST /api/v1/jobs/{id}/events (an admin token).",
    )  # fmt: skip
    for field in dataclasses.fields(FleetModel):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default,
                            help=f"{HELP[field.name]} (default {field.default:g})")  # fmt: skip
    parser.add_argument("--service", help="replay into the service at this URL (default: in memory, no service)")
    parser.add_argument("--token", default=os.environ.get("ETT_TOKEN"), help="admin token for --service (ETT_TOKEN)")
    parser.add_argument("--batch", type=int, default=5000, help="events per request when replaying")
    parser.add_argument("--sweep", action="store_true", help="also simulate intervals around Young's, in memory")
    parser.add_argument("--all-failures", action="store_true", help="list every failure (default: the first 5)")
    parser.add_argument("--json", action="store_true", help="print the raw report")
    parser.set_defaults(run=run)


def replay(url: str, token: str, model: FleetModel, events: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """Creates a record job for the timeline, replays it in batches and returns the service's report.
    The job is cancelled before the replay, so no scheduler ever tries to run it."""
    spec = {"name": f"sim-{model.nodes}x{model.gpus_per_node}-{model.days:g}d-seed{model.seed}",
            "nodes": min(model.nodes, 4096), "procs_per_node": min(model.gpus_per_node, 64)}  # fmt: skip
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
        job = _ok(client.post("/api/v1/jobs", json=spec))
        _ok(client.post(f"/api/v1/jobs/{job['id']}/cancel"))
        accepted = duplicates = 0
        for i in range(0, len(events), batch):
            counts = _ok(client.post(f"/api/v1/jobs/{job['id']}/events", json={"events": events[i : i + batch]}))
            accepted, duplicates = accepted + counts["accepted"], duplicates + counts["duplicates"]
        print(f"ett simulate: replayed {accepted:,} events ({duplicates} duplicates) into job {job['id']} at {url}")
        return _ok(client.get(f"/api/v1/jobs/{job['id']}/ett"))


def _ok(response: httpx.Response) -> Any:
    if response.is_error:
        sys.exit(f"ett simulate: {response.request.method} {response.request.url.path} answered "
                 f"{response.status_code}: {response.json().get('detail')}")  # fmt: skip
    return response.json()


def run(args: argparse.Namespace) -> int:
    try:
        model = FleetModel(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FleetModel)})
    except ValueError as exc:
        print(f"ett simulate: {exc}", file=sys.stderr)
        return 2
    if args.service and not args.token:
        print("ett simulate: --service needs an admin token (--token or ETT_TOKEN)", file=sys.stderr)
        return 2
    end_ts = time.time()
    if args.service:
        events = simulate(model, end_ts)
        try:
            report = replay(args.service, args.token, model, events, args.batch)
        except httpx.HTTPError as exc:
            sys.exit(f"ett simulate: cannot reach the service at {args.service}: {exc}")
    else:
        events, report = memory_report(model, end_ts)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    steps = sum(e["kind"] == "step" for e in events)
    gpus = model.nodes * model.gpus_per_node
    print(f"ett simulate: {model.days:g} days of a {model.nodes:,}-node job ({gpus:,} GPUs), "
          f"MTBF {model.mtbf_seconds / 3600:.2f} h, seed {model.seed}: {len(events):,} events, a step event per "
          f"{model.steps_per_event} steps of {model.step_seconds:g} s ({steps:,} of them)")  # fmt: skip
    print(report_table(report, max_failures=None if args.all_failures else 5))
    print(f"\nanalytical ETT {100 * expected_ett(model):.1f}% (renewal-reward, service/ett/simulate.py) at the "
          f"simulated interval {model.interval_seconds:g} s; Young's interval of the model "
          f"{young_interval_seconds(model):.0f} s")
    if args.sweep:
        young = young_interval_seconds(model)
        print(f"\n  {'interval':>10} {'simulated':>10} {'analytical':>10}")
        for mi, ri in sweep(model, [young * f for f in SWEEP_FACTORS], end_ts):
            print(f"  {mi.interval_seconds:>8.0f} s {ri['ett_percent']:>9.2f}% {100 * expected_ett(mi):>9.2f}%")
    return 0
