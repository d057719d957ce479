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

from ett_cli.render import report_table
from service.accounting.simulate import (
    FleetModel,
    expected_ett,
    memory_report,
    simulate,
    sweep,
    tier_models,
    young_interval_seconds,
)
from service.accounting.simulate_elastic import ElasticModel, elastic_vs_waiting
from service.accounting.simulate_stragglers import StragglerModel, straggler_sweep

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
    "local_interval_seconds": "training time between node-local snapshots (the fast tier); 0: none",
    "local_blocking_seconds": "pause of one node-local snapshot",
    "local_restore_seconds": "resuming from node-local snapshots",
    "local_replicated": "each snapshot also kept on a peer node: a lost node's ranks resume from the copies",
    "replication_seconds": "how long after it is taken a snapshot's copy reaches its peer",
    "peer_restore_seconds": "a lost node's replacement fetching its ranks' snapshots from the peers",
    "adaptive_detection": "catch hangs after max(3 s, 4 steps) instead of the hang timeout",
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
    for field in dataclasses.fields(FleetModel):  # None: not given (the model's default, or the job's figure)
        flag, default = f"--{field.name.replace('_', '-')}", field.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=HELP[field.name])
        else:
            parser.add_argument(flag, type=type(default), default=None,
                                help=f"{HELP[field.name]} (default {default:g})")
    parser.add_argument("--service", help="replay into the service at this URL (default: in memory, no service)")
    parser.add_argument("--token", default=os.environ.get("ETT_TOKEN"), help="admin token for --service (ETT_TOKEN)")
    parser.add_argument("--batch", type=int, default=5000, help="events per request when replaying")
    parser.add_argument("--sweep", action="store_true", help="also simulate intervals around Young's, in memory")
    parser.add_argument("--tiers", action="store_true", help="the job with the persistent tier only, with node-"
                        "local snapshots (and adaptive hang detection), and with them replicated to a peer, each at "
                        "its recommended intervals, side by side")
    parser.add_argument("--from-job", metavar="JOB", help="take init, restore, checkpoint and step times from a "
                        "job's report in the service at --service (they override the defaults; flags win); "
                        "implies --tiers")
    parser.add_argument("--stragglers", action="store_true", help="slow nodes instead of failures: the job's "
                        "full-speed share with stragglers reported against replaced when that pays, for slowdowns "
                        "of several sizes (service/accounting/simulate_stragglers.py)")
    parser.add_argument("--straggler-rate", type=float, default=StragglerModel.rate_per_node_day,
                        help="slowdowns starting per node per day (default %(default)g)")
    parser.add_argument("--elastic-vs-waiting", action="store_true", help="a fleet with few spares: the same work "
                        "and failures, the job waiting for a spare against going on at fewer nodes and growing back "
                        "(service/accounting/simulate_elastic.py); --days is the work, at full size")
    parser.add_argument("--spares", type=int, default=ElasticModel.spares, help="spare nodes of the fleet "
                        "(default %(default)d)")
    parser.add_argument("--spare-wait-seconds", type=float, default=ElasticModel.spare_wait_seconds,
                        help="a failed node is a spare again this long after it failed (default %(default)g)")
    parser.add_argument("--min-nodes", type=int, default=None, help="the elastic job's smallest size (default: "
                        "half its nodes)")
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


# A snapshot's cost when the job gives none (snapshots are not events): the fast tier's budget, at
# most this share of a step (ett/snapshots/tier.py), which it keeps to by snapshotting less often.
SNAPSHOT_SHARE_OF_STEP = 0.05


def measured_costs(report: dict[str, Any]) -> dict[str, float]:
    """The model's costs as a job measured them (its ETT report): mean start-up and restore per
    attempt, mean save blocking and commit, mean kept step. Only what the job has figures for."""
    seconds, attempts, restores = report["seconds"], report["restarts"] + 1, report["restarts"]
    costs = {"init_seconds": seconds["init"] / attempts}
    if restores:
        costs["restore_seconds"] = costs["local_restore_seconds"] = seconds["restore"] / restores
    if report["last_step"]:
        costs["step_seconds"] = seconds["productive"] / report["last_step"]
    checkpoints = report["checkpoints"]
    if checkpoints["mean_blocking_seconds"] is not None:
        costs["checkpoint_blocking_seconds"] = checkpoints["mean_blocking_seconds"]
    if checkpoints["mean_commit_seconds"] is not None:
        costs["checkpoint_write_seconds"] = checkpoints["mean_commit_seconds"]
    return costs


def job_report(url: str, token: str, job_id: str) -> dict[str, Any]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        return _ok(client.get(f"/api/v1/jobs/{job_id}/ett"))


def print_tiers(model: FleetModel, end_ts: float) -> None:
    """The persistent tier only, with node-local snapshots, and with them replicated to a peer, side
    by side, on the same failure times."""
    runs = {label: (m, memory_report(m, end_ts)[1]) for label, m in tier_models(model).items()}

    def mean(report: dict[str, Any], key: str) -> str:
        values = [f[key] for f in report["failures"] if f[key] is not None]
        return f"{sum(values) / len(values):.1f}" if values else "-"

    def local_interval(m: FleetModel) -> str:
        return f"{m.blocks_per_snapshot * m.block_seconds:.0f}" if m.blocks_per_snapshot else "-"

    rows = [
        ("persistent interval (s)", lambda m, r: f"{m.interval_seconds:.0f}"),
        ("node-local interval (s)", lambda m, r: local_interval(m)),
        ("hang detection (s)", lambda m, r: f"{m.detection_seconds('hang'):g}"),
        ("ETT (simulated)", lambda m, r: f"{r['ett_percent']:.2f}%"),
        ("failures", lambda m, r: f"{len(r['failures'])}"),
        ("mean time to recover (s)", lambda m, r: mean(r, "time_to_recover_seconds")),
        ("mean lost steps", lambda m, r: mean(r, "lost_steps")),
        ("checkpoint_save share", lambda m, r: f"{100 * r['seconds']['checkpoint_save'] / r['wall_seconds']:.2f}%"),
        ("idle share (snapshots)", lambda m, r: f"{100 * r['seconds']['idle'] / r['wall_seconds']:.2f}%"),
    ]  # fmt: skip
    print(f"\n  {'':26}" + "".join(f"{label:>18}" for label in runs))
    for name, cell in rows:
        print(f"  {name:26}" + "".join(f"{cell(m, r):>18}" for m, r in runs.values()))


def print_stragglers(model: FleetModel, rate: float) -> None:
    restart = model.restart_seconds + model.init_seconds + model.restore_seconds
    m = StragglerModel(nodes=model.nodes, days=model.days, step_seconds=model.step_seconds, rate_per_node_day=rate,
                       restart_seconds=restart, seed=model.seed)  # fmt: skip
    print(f"ett simulate --stragglers: {m.days:g} days of a {m.nodes:,}-node job ({m.nodes * model.gpus_per_node:,} "
          f"GPUs), step {m.step_seconds:g} s; {rate:g} slowdowns per node per day, flagged after "
          f"{m.detection_steps} steps; a restart costs {restart:.0f} s; seed {m.seed}. Full-speed share of the wall:")
    print(f"  {'lasting':>8} {'median slowdown':>15} {'slowdowns':>9} {'report':>8} {'replace':>8} {'replaced':>8} "
          f"{'restarting h':>12}")
    for median, hours, report, replace in straggler_sweep(m):
        better = "<" if replace.full_speed_percent < report.full_speed_percent else " "
        print(f"  {hours:>7g}h {median:>14.2f}x {report.slowdowns:>9} {report.full_speed_percent:>7.2f}% "
              f"{replace.full_speed_percent:>7.2f}%{better}{replace.replaced:>8} "
              f"{replace.restart_seconds / 3600:>12.1f}")


def print_elastic(m: ElasticModel) -> None:
    f = m.fleet
    print(f"ett simulate --elastic-vs-waiting: the work of {f.days:g} days of a {f.nodes:,}-node job "
          f"({f.nodes * f.gpus_per_node:,} GPUs) at full size, MTBF {f.mtbf_seconds / 3600:.2f} h, every failure "
          f"takes its node out; spares {m.spares}, a failed node a spare again after "
          f"{m.spare_wait_seconds / 3600:g} h; elastic down to {m.floor:,} nodes; seed {f.seed}")  # fmt: skip
    runs = elastic_vs_waiting(m)
    rows = [
        ("wall time (days)", lambda r: f"{r.report['wall_seconds'] / 86400:.2f}"),
        ("ETT", lambda r: f"{r.report['ett_percent']:.2f}%"),
        ("capacity", lambda r: f"{r.report['capacity_percent']:.2f}%"),
        ("reduced capacity (h)", lambda r: f"{r.report['reduced_capacity_seconds'] / 3600:.2f}"),
        ("recovery (h)", lambda r: f"{r.report['seconds']['recovery'] / 3600:.1f}"),
        ("failures", lambda r: f"{len(r.report['failures'])}"),
        ("restarts", lambda r: f"{r.report['restarts']}"),
        ("attempts at reduced size", lambda r: f"{r.reduced_attempts}"),
    ]  # fmt: skip
    print(f"\n  {'':26}" + "".join(f"{r.policy:>12}" for r in runs))
    for name, cell in rows:
        print(f"  {name:26}" + "".join(f"{cell(r):>12}" for r in runs))


def run(args: argparse.Namespace) -> int:
    if (args.service or args.from_job) and not args.token:
        print("ett simulate: --service and --from-job need a token (--token or ETT_TOKEN)", file=sys.stderr)
        return 2
    if args.from_job and not args.service:
        print("ett simulate: --from-job needs --service, the service that ran the job", file=sys.stderr)
        return 2
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(FleetModel) if getattr(args, f.name) is not None}
    measured: dict[str, float] = {}
    if args.from_job:
        try:
            measured = measured_costs(job_report(args.service, args.token, args.from_job))
        except httpx.HTTPError as exc:
            sys.exit(f"ett simulate: cannot reach the service at {args.service}: {exc}")
        print(f"ett simulate: costs measured by job {args.from_job}: "
              + ", ".join(f"{k} {v:.3g}" for k, v in measured.items() if k not in given))  # fmt: skip
    try:
        model = FleetModel(**(measured | given))
        if args.from_job and "local_blocking_seconds" not in given:
            model = dataclasses.replace(model, local_blocking_seconds=SNAPSHOT_SHARE_OF_STEP * model.step_seconds)
    except ValueError as exc:
        print(f"ett simulate: {exc}", file=sys.stderr)
        return 2
    end_ts = time.time()
    if args.elastic_vs_waiting:
        try:
            elastic = ElasticModel(model, args.spares, args.spare_wait_seconds, args.min_nodes)
        except ValueError as exc:
            print(f"ett simulate: {exc}", file=sys.stderr)
            return 2
        print_elastic(elastic)
        return 0
    if args.stragglers:
        print_stragglers(model, args.straggler_rate)
        return 0
    if args.tiers or args.from_job:
        print(f"ett simulate: {model.days:g} days of a {model.nodes:,}-node job, "
              f"MTBF {model.mtbf_seconds / 3600:.2f} h, step {model.step_seconds:.3g} s, "
              f"save blocking {model.checkpoint_blocking_seconds:.3g} s, "
              f"snapshot {model.local_blocking_seconds:.3g} s, seed {model.seed}")
        print_tiers(model, end_ts)
        return 0
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
    print(f"\nanalytical ETT {100 * expected_ett(model):.1f}% (renewal-reward, service/accounting/simulate.py) at the "
          f"simulated interval {model.interval_seconds:g} s; Young's interval of the model "
          f"{young_interval_seconds(model):.0f} s")
    if args.sweep:
        young = young_interval_seconds(model)
        print(f"\n  {'interval':>10} {'simulated':>10} {'analytical':>10}")
        for mi, ri in sweep(model, [young * f for f in SWEEP_FACTORS], end_ts):
            print(f"  {mi.interval_seconds:>8.0f} s {ri['ett_percent']:>9.2f}% {100 * expected_ett(mi):>9.2f}%")
    return 0
