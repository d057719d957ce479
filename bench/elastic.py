"""Elastic against waiting for a spare (issue #51): the same job run twice in one invocation.

examples/plain_ddp.py as a 2-node job of 1 rank each, on a live service and real agents
(tests/support/cluster.py, the agents' default heartbeat settings as bench/node_loss.py): node 1
is lost (agent, ranks and node-local folder at once, `Cluster.lose_node`) once rank 0 has stepped
--lose-at, with no spare registered; a spare agent, node-2, starts --spare-after seconds after the
loss (not at all if the job has finished by then).

- elastic: `elastic = {min_nodes = 1}`: it goes on at once on node 0 alone, the global batch kept
  by accumulation, and grows back to 2 nodes at a checkpoint once node-2 registers, if that pays.
- waiting: no `elastic`: it waits, idle, for node-2.

The example's compute is a sleep per micro batch (--micro-batch-seconds), so a step at 1 node
takes twice as long as at 2 (it runs both ranks' micro batches), as a compute-bound step would.

    .venv/bin/python bench/elastic.py --steps 240 --lose-at 30 --spare-after 60
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support, before node_loss imports it

from node_loss import DEFAULT_HEARTBEATS  # noqa: E402
from recovery import finished_job_report, print_table  # noqa: E402

from ett_cli.render import CATEGORY_ORDER  # noqa: E402
from service.accounting.engine import Event  # noqa: E402
from tests.support.cluster import TERMINAL, Cluster, cluster, events, example_job  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402

MODES = ("elastic", "waiting")


def job_spec(args, mode: str) -> dict:
    ddp = ["--steps", str(args.steps), "--step-seconds", "0", "--micro-batch-seconds", str(args.micro_batch_seconds)]
    elastic = {"elastic": {"min_nodes": 1}} if mode == "elastic" else {}
    return example_job("plain_ddp.toml", name=f"bench-{mode}", max_restarts=4, hang_timeout_seconds=120,
                       entrypoint=["python", "examples/plain_ddp.py", *ddp],
                       checkpoint={"interval_steps": args.interval, "keep": 3, "snapshots": True},
                       **elastic)  # fmt: skip


def start_agents(c: Cluster, *names: str) -> None:
    for name in names:
        c.start_agent(name, slots=1, wait=False, **DEFAULT_HEARTBEATS)
    for name in names:
        c.wait_registered(name)


def run_mode(args, mode: str, root: Path) -> dict[str, object]:
    root.mkdir(parents=True)
    with cluster(root) as c:
        start_agents(c, "node-0", "node-1")
        job_id = c.submit(**job_spec(args, mode))
        wait_for(lambda: any(e.attempt == 0 and e.step >= args.lose_at for e in events(c, job_id, "step")), 600,
                 f"step {args.lose_at}")  # fmt: skip
        victim = c.job(job_id)["attempts"][0]["nodes"][1]
        lost_at = time.time()
        c.lose_node(victim, job_id)
        spare_at = lost_at + args.spare_after
        while time.time() < spare_at and c.job(job_id)["state"] not in TERMINAL:
            time.sleep(0.5)
        spare = None
        if c.job(job_id)["state"] not in TERMINAL:
            start_agents(c, "node-2")
            spare = time.time() - lost_at
        report, found = finished_job_report(c, job_id)
    return summary(report, found, lost_at, spare)


def summary(report: dict, found: list[Event], lost_at: float, spare: float | None) -> dict[str, object]:
    steps_after = [e.ts for e in found if e.kind == "step" and e.source == "rank:0" and e.attempt > 0]
    causes = {e.attempt: e.data.get("cause") for e in found if e.kind == "attempt_failed" and e.source == "service"}
    attempts = [f"{s['attempt']}: {s['nodes']}/{s['full_nodes']} {causes.get(s['attempt'], '')}".rstrip()
                for s in report["attempt_sizes"]]  # fmt: skip
    return {
        "wall s": report["wall_seconds"],
        "ETT %": report["ett_percent"],
        "capacity %": report["capacity_percent"],
        "reduced capacity s": report["reduced_capacity_seconds"],
        **{f"{category} s": report["seconds"][category] for category in CATEGORY_ORDER},
        "loss to the next step s": min(steps_after) - lost_at if steps_after else None,
        "time to recover s (report)": report["failures"][0]["time_to_recover_seconds"],
        "spare registered s after the loss": spare if spare is not None else "not started: finished",
        "attempts (nodes/full)": "; ".join(attempts),
        "lost steps": sum(f["lost_steps"] for f in report["failures"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--lose-at", type=int, default=30, help="lose node 1 once rank 0 has stepped this far")
    parser.add_argument("--spare-after", type=float, default=60.0, help="seconds from the loss to the spare's start")
    parser.add_argument("--micro-batch-seconds", type=float, default=0.2, help="a step at full size: 1 micro batch")
    parser.add_argument("--interval", type=int, default=5, help="checkpoint every K steps")
    args = parser.parse_args()

    print(f"load average before: {os.getloadavg()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    rows = {}
    for mode in MODES:
        rows[mode] = run_mode(args, mode, root / mode)
        print(f"{mode} done; load average {os.getloadavg()}", flush=True)
    shutil.rmtree(root)  # kept, with the logs, when a run fails
    print()
    print_table(rows["elastic"], rows["waiting"], names=MODES)
    elastic, waiting = rows["elastic"], rows["waiting"]
    print(f"\nelastic/waiting wall = {elastic['wall s'] / waiting['wall s']:.2f}; "
          f"ETT {elastic['ETT %'] - waiting['ETT %']:+.1f} points, "
          f"capacity {elastic['capacity %'] - waiting['capacity %']:+.1f} points")


if __name__ == "__main__":
    main()
