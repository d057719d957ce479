"""A team's own scripts (examples/hf_trainer.py, examples/plain_ddp.py) recovering from a SIGKILL,
started warm (the job's `warm_imports`: the agents' warm server imports them once and forks each
rank) against cold (a fresh interpreter per rank), side by side in one run.

Each example's job file, as an ETT job on 2 real agents (tests/support/cluster.py), rank 1
SIGKILLed at step 13; the report gives the failure's time to recover (last step end to the next
attempt's first step start) and the time to start; bench/recovery.py splits the time to recover
into its parts.

    .venv/bin/python bench/script_recovery.py
"""

import argparse
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from bench.recovery import recovery_parts  # noqa: E402
from service.accounting.engine import Event  # noqa: E402
from tests.support.cluster import cluster, events, example_job  # noqa: E402

KILL = {"attempt": 0, "rank": 1, "at_step": 13, "action": "kill"}
EXAMPLES = {"hf_trainer": "hf_trainer.toml", "plain_ddp": "plain_ddp.toml"}


def run(root: Path, job_file: str, warm: bool) -> dict:
    spec = example_job(job_file, faults=[KILL], max_restarts=1)
    if not warm:
        spec["warm_imports"] = []
    root.mkdir(parents=True)
    with cluster(root) as c:
        c.start_agents("node-a", "node-b")
        job = c.wait_job(c.submit(**spec), timeout=600)
        if job["state"] != "succeeded":
            raise SystemExit(f"{job_file}: {job['state']}: {job.get('reason')}\n{c.logs()}")
        report = c.report(job["id"])
        all_events = [Event(e.kind, e.ts, e.attempt, e.source, e.seq, e.step, dict(e.data))
                      for kind in ("step", "ckpt_staged", "restore_start", "restore_end", "init_start", "init_end",
                                   "attempt_failed", "attempt_allocated")
                      for e in events(c, job["id"], kind)]  # fmt: skip
    [failure] = report["failures"]
    return {"time to start s": report["time_to_start_seconds"], "time to recover s": failure["time_to_recover_seconds"],
            **{f"  {k} s": v for k, v in recovery_parts(sorted(all_events, key=lambda e: e.ts), 0).items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
    args = parser.parse_args()
    with TemporaryDirectory() as tmp:
        for name in args.examples:
            rows = {mode: run(Path(tmp) / f"{name}-{mode}", EXAMPLES[name], warm=mode == "warm")
                    for mode in ("cold", "warm")}
            print(f"\n{name}: {'':24} {'cold':>8} {'warm':>8} {'warm/cold':>10}")
            for key in rows["cold"]:
                cold, warm = rows["cold"][key], rows["warm"][key]
                ratio = f"{warm / cold:.2f}x" if cold else "-"
                print(f"  {key:32} {cold:>8.2f} {warm:>8.2f} {ratio:>10}")


if __name__ == "__main__":
    main()
