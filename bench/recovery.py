"""Recovery under ETT against plain `torchrun --max-restarts` with synchronous torch.save checkpoints.

The same job (preset, overrides, ranks, checkpoint interval) and the same faults (SIGKILL of one
rank at given steps, one per attempt) in both runs:

- ETT: a live service and real agent daemons (tests/support/cluster.py); the agent injects the
  faults; the report and the events come from the service. The job has the node-local tier
  (`checkpoint.snapshots`, as the demo) unless --no-snapshots.
- baseline: `torchrun --standalone --max-restarts R bench/baseline_train.py`; this process tails
  rank 0's spool and SIGKILLs the rank's pid at the same steps. Its service-side events are made
  up from what is seen (see `baseline_service_events`, and BENCHMARKS.md), and the same ETT
  engine (MemoryJob) builds the report from them and the ranks' spools.

    .venv/bin/python bench/recovery.py --preset cpu-demo --steps 60 --interval 10 --kill-steps 25 45

With --lose-node, a whole node is lost instead (bench/node_loss.py: ETT's peer evidence and spare
against torchrun's c10d rendezvous and --max-restarts), at the first of --kill-steps:

    .venv/bin/python bench/recovery.py --lose-node --procs 1 --steps 60 --interval 10 --kill-steps 25
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from ett_cli.render import CATEGORY_ORDER  # noqa: E402
from service.accounting.engine import Event  # noqa: E402
from service.accounting.memory import MemoryJob  # noqa: E402
from service.models import JobEvent  # noqa: E402
from tests.support.cluster import cluster, trainer_job  # noqa: E402

PARTS = ("detection", "teardown", "relaunch", "init", "restore", "first step")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def recovery_parts(events: list[Event], attempt: int) -> dict[str, float]:
    """Time to recover from the failure of `attempt`, cut at the events that bound each part:
    last activity | attempt_failed | next attempt_allocated | its rank 0's init_start | restore_start
    | restore_end | first step start."""
    at: dict[tuple[int, str], list[float]] = defaultdict(list)
    step_starts: dict[int, list[float]] = defaultdict(list)
    for e in events:
        if e.source in ("service", "rank:0"):
            at[(e.attempt, e.kind)].append(e.ts)
            if e.kind == "step":
                step_starts[e.attempt].append(e.ts - float(e.data.get("duration", 0.0)))
    nxt = attempt + 1
    last_activity = max(ts for kind in ("step", "ckpt_staged", "restore_end", "init_end") for ts in at[(attempt, kind)])
    restore_start = min(at[(nxt, "restore_start")] or at[(nxt, "init_end")])
    restore_end = min(at[(nxt, "restore_end")] or at[(nxt, "init_end")])
    cuts = [last_activity, min(at[(attempt, "attempt_failed")]), min(at[(nxt, "attempt_allocated")]),
            min(at[(nxt, "init_start")]), restore_start, restore_end, min(step_starts[nxt])]  # fmt: skip
    return {part: b - a for part, a, b in zip(PARTS, cuts, cuts[1:], strict=False)}


def trainer_flags(args) -> dict[str, str]:
    return {"train.steps": str(args.steps), **dict(kv.split("=", 1) for kv in args.set)}


def run_ett(args, root: Path) -> tuple[dict, list[Event]]:
    faults = [{"attempt": n, "rank": args.kill_rank, "at_step": s, "action": "kill"} for n, s in enumerate(args.kill_steps)]
    spec = trainer_job(
        "bench-recovery", nodes=args.nodes, procs_per_node=args.procs, faults=faults, max_restarts=len(faults),
        trainer={"preset": args.preset, "overrides": trainer_flags(args)}, hang_timeout_seconds=120,
        checkpoint={"interval_steps": args.interval, "keep": 3, "snapshots": args.snapshots},
    )  # fmt: skip
    root.mkdir(parents=True)
    with cluster(root) as c:
        for n in range(args.nodes):
            c.start_agent(f"node-{n}", slots=args.procs)
        return finished_job_report(c, c.submit(**spec))


def finished_job_report(c, job_id: str) -> tuple[dict, list[Event]]:
    """The job's report and its events once it has succeeded (SystemExit, with the logs, if not)."""
    job = c.wait_job(job_id, timeout=1800)
    if job["state"] != "succeeded":
        raise SystemExit(f"ETT job {job['state']}: {job.get('reason')}\n{c.logs()}")
    with c.service.context.sessions() as session:
        rows = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id)).all()
        events = [Event(r.kind, r.ts, r.attempt, r.source, r.seq, r.step, dict(r.data)) for r in rows]
    return c.report(job_id), events


def read_spool(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # a line torn by the kill
            continue
    return lines


def watch_torchrun_log(stream, log: Path, marks: list[tuple[float, str]]) -> None:
    """Copies torchrun's stderr to `log`, noting (timed on arrival) when its agent starts a worker
    group and when it first acts on a failure: its first 'closing signal' to the survivors, or
    'Worker group FAILED' if none was left to close."""
    failing = False
    with open(log, "w") as out:
        for line in stream:
            now = time.time()
            out.write(line)
            if "Starting worker group" in line:
                marks.append((now, "started"))
                failing = False
            elif not failing and ("closing signal" in line or "Worker group FAILED" in line):
                marks.append((now, "failed"))
                failing = True


def baseline_service_events(launched: float, finished: float, rc: int, marks: list[tuple[float, str]]) -> list[Event]:
    """attempt_allocated of attempt 0 = torchrun's launch; attempt_failed of attempt n = torchrun's
    n-th failure mark (see watch_torchrun_log); attempt_allocated of attempt n+1 = its next 'Starting worker group'
    (the old group stopped, rendezvous done, about to spawn); job_finished = torchrun's exit."""
    events = [("attempt_allocated", launched, 0, {})]
    attempt = 0
    for ts, what in marks:
        if what == "failed":
            events.append(("attempt_failed", ts, attempt, {"cause": "signal"}))
            attempt += 1
        elif attempt > 0 and not any(e[0] == "attempt_allocated" and e[2] == attempt for e in events):
            events.append(("attempt_allocated", ts, attempt, {}))
    events.append(("job_finished", finished, attempt, {"state": "succeeded" if rc == 0 else "failed"}))
    return [Event(kind, ts, n, "service", seq, None, data) for seq, (kind, ts, n, data) in enumerate(events)]


def run_baseline(args, root: Path) -> tuple[dict, list[Event]]:
    spool, ckpt = root / "spool", root / "checkpoints"
    root.mkdir(parents=True)
    flags = {**trainer_flags(args), "checkpoint.dir": str(ckpt), "checkpoint.interval_steps": str(args.interval)}
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(args.nodes * args.procs),
           "--max-restarts", str(len(args.kill_steps)), str(Path(__file__).with_name("baseline_train.py")),
           "--preset", args.preset, *[x for k, v in flags.items() for x in (f"--{k}", v)]]  # fmt: skip
    env = {**os.environ, "ETT_EVENT_DIR": str(spool), "LOGLEVEL": "INFO"}
    marks: list[tuple[float, str]] = []
    launched = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    reader = threading.Thread(target=watch_torchrun_log, args=(proc.stderr, root / "torchrun.log", marks))
    reader.start()
    killed = 0  # faults injected so far: the next one is for attempt `killed`
    try:
        while proc.poll() is None:
            attempt = killed
            if attempt < len(args.kill_steps):
                steps = [e["step"] for e in read_spool(spool / "rank-0.jsonl") if e["kind"] == "step" and e["attempt"] == attempt]
                if steps and max(steps) >= args.kill_steps[attempt]:
                    target = spool / f"rank-{args.kill_rank}.jsonl"
                    [pid] = [e["data"]["pid"] for e in read_spool(target) if e["kind"] == "init_start" and e["attempt"] == attempt]
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
        reader.join()
    finished = time.time()
    if rc != 0:
        raise SystemExit(f"baseline torchrun exited {rc}; see {root / 'torchrun.log'}")
    events = [Event(e["kind"], e["ts"], e["attempt"], e["source"], e["seq"], e["step"], e["data"])
              for path in sorted(spool.glob("rank-*.jsonl")) for e in read_spool(path)]  # fmt: skip
    events += baseline_service_events(launched, finished, rc, marks)
    job = MemoryJob("baseline")
    job.ingest(events)
    return job.report(finished), events


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary(report: dict, events: list[Event]) -> dict[str, object]:
    rows: dict[str, object] = {"ETT %": report["ett_percent"], "wall s": report["wall_seconds"]}
    rows |= {f"{c} s": report["seconds"][c] for c in CATEGORY_ORDER}
    ttrs = []
    for f in report["failures"]:
        parts = recovery_parts(events, f["attempt"])
        ttrs.append(f["time_to_recover_seconds"])
        rows[f"failure {f['attempt']}: time to recover s"] = f["time_to_recover_seconds"]
        rows |= {f"failure {f['attempt']}:   {p} s": v for p, v in parts.items()}
        rows[f"failure {f['attempt']}:   lost steps"] = f["lost_steps"]
    rows["mean time to recover s"] = mean(ttrs)
    rows["checkpoints committed"] = report["checkpoints"]["committed"]
    rows["mean checkpoint blocking s"] = report["checkpoints"]["mean_blocking_seconds"]
    return rows


def print_table(ett: dict[str, object], base: dict[str, object], names: tuple[str, str] = ("ETT", "baseline")) -> None:
    def cell(v):
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    print(f"| {'':40} | {names[0]:>8} | {names[1]:>8} |\n| {'-' * 40} | {'-' * 8} | {'-' * 8} |")
    for key in dict.fromkeys([*ett, *base]):
        print(f"| {key:40} | {cell(ett.get(key)):>8} | {cell(base.get(key)):>8} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu-demo")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint every K steps")
    parser.add_argument("--kill-steps", type=int, nargs="+", default=[25, 45], help="one per attempt")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=2, help="ETT agents; the baseline runs nodes x procs ranks on one torchrun")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--snapshots", action=argparse.BooleanOptionalAction, default=True,
                        help="ETT's node-local tier (the job's checkpoint.snapshots), as the demo runs; the "
                        "baseline has none (torch.save every --interval steps)")
    parser.add_argument("--lose-node", action="store_true", help="lose a whole node (bench/node_loss.py)")
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE", help="more trainer overrides")
    args = parser.parse_args()

    print(f"load average before: {os.getloadavg()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    if args.lose_node:  # imported here: it builds on this module's parts
        import node_loss

        ett_run, baseline_run = node_loss.run_ett, node_loss.run_baseline
    else:
        ett_run, baseline_run = run_ett, run_baseline
    ett_report, ett_events = ett_run(args, root / "ett")
    print(f"ETT done; load average {os.getloadavg()}", flush=True)
    base_report, base_events = baseline_run(args, root / "baseline")
    print(f"baseline done; load average {os.getloadavg()}\n", flush=True)
    shutil.rmtree(root)  # kept, with the logs, when a run fails
    ett, base = summary(ett_report, ett_events), summary(base_report, base_events)
    print_table(ett, base)
    ttr_ratio = ett["mean time to recover s"] / base["mean time to recover s"]
    ett_gain = ett["ETT %"] - base["ETT %"]
    print(f"\ntime to recover ETT/baseline = {ttr_ratio:.2f} (target <= 0.25, issue #21: {'met' if ttr_ratio <= 0.25 else 'missed'})")
    print(f"ETT% gain = {ett_gain:+.1f} points (target >= +10: {'met' if ett_gain >= 10 else 'missed'})")


if __name__ == "__main__":
    main()
