"""A team's own scripts (examples/hf_trainer.py, examples/plain_ddp.py) recovering from a SIGKILL,
their job naming its `warm_imports` (the agents' warm server imports them once and forks each rank)
against naming none (the agents learn what the first attempt imported and warm that: issue #49),
side by side in one run; `--modes cold` adds a run with no warm start at all (a job `env` rules it out).

Each example's job file, as an ETT job on 2 real agents (tests/support/cluster.py), rank 1
SIGKILLed at step 13 (`--kill-step`); the report gives the failure's time to recover (last step end
to the next attempt's first step start) and the time to start; bench/recovery.py splits the time to
recover into its parts.

    .venv/bin/python bench/script_recovery.py [--examples hf_trainer plain_ddp] [--modes learned named cold]
"""

import argparse
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from bench.recovery import recovery_parts  # noqa: E402
from service.accounting.engine import Event  # noqa: E402
from tests.support.cluster import cluster, events, example_job  # noqa: E402

EXAMPLES = {"hf_trainer": "hf_trainer.toml", "plain_ddp": "plain_ddp.toml"}
MODES = ("learned", "named", "cold")


def run(root: Path, job_file: str, mode: str, kill_step: int) -> dict:
    spec = example_job(job_file, faults=[{"attempt": 0, "rank": 1, "at_step": kill_step, "action": "kill"}],
                       max_restarts=1)
    if mode != "named":
        spec["warm_imports"] = []
    if mode == "cold":  # variables read at import could not take effect in a warm server: none is used
        spec["env"] = {"BENCH_COLD": "1"}
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
    parser.add_argument("--modes", nargs="+", default=["learned", "named"], choices=MODES)
    parser.add_argument("--kill-step", type=int, default=13)
    args = parser.parse_args()
    with TemporaryDirectory() as tmp:
        for name in args.examples:
            rows = {mode: run(Path(tmp) / f"{name}-{mode}", EXAMPLES[name], mode, args.kill_step)
                    for mode in args.modes}
            print(f"\n{name} (rank 1 killed at step {args.kill_step}): {'':4}"
                  + "".join(f"{mode:>9}" for mode in args.modes), flush=True)
            for key in rows[args.modes[0]]:
                print(f"  {key:32}" + "".join(f"{rows[mode][key]:>9.2f}" for mode in args.modes), flush=True)


if __name__ == "__main__":
    main()
