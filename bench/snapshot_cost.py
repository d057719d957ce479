"""What the fast tier costs a training step: the same cpu-demo run (EP 2, ZeRO-3; 2 ranks, or
4 as in `ett demo`) with and without local snapshots (ett/snapshots.py), alternated, median step
time of each.

    .venv/bin/python bench/snapshot_cost.py [--steps 40] [--rounds 2] [--nproc 2] [--every 0]

`--every 0` lets the fast tier choose its cadence (every step its cost allows); `--every 1`
snapshots after every step whatever it costs. Prints each run's median step time (rank 0's
`step` events, which end before the snapshot), the median time between step ends (which includes
it), the cadence rank 0 settled on (from its log), and the ratio of the time between step ends
with snapshots to without: the target is at most 1.05 (issue #21).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(steps: int, snapshots: bool, nproc: int, every: int) -> tuple[float, float, int]:
    """Median step time, median time between step ends, and rank 0's last snapshot cadence."""
    with tempfile.TemporaryDirectory() as root:
        env = os.environ | {"ETT_EVENT_DIR": f"{root}/events", "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "-m", "trainer.train", "--preset", "cpu-demo", "--train.steps", str(steps),
                "--checkpoint.dir", f"{root}/ckpt", "--checkpoint.local_dir", f"{root}/local",
                "--checkpoint.interval_steps", "1000", "--checkpoint.snapshots", "true" if snapshots else "false",
                "--checkpoint.snapshot_every", str(every)]
        done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
        events = [json.loads(line) for line in Path(root, "events", "rank-0.jsonl").read_text().splitlines()]
    steps_ = [e for e in events if e["kind"] == "step"][5:]  # past the warm-up
    gaps = [b["ts"] - a["ts"] for a, b in zip(steps_, steps_[1:])]
    # The cadence the fast tier ended on (rank 0 logs each change, ett/snapshots.py): 1 is every step.
    changes = [int(m) for m in re.findall(r"local snapshots every (\d+) steps", done.stdout + done.stderr)]
    cadence = changes[-1] if changes else every or 1
    return statistics.median(e["data"]["duration"] for e in steps_), statistics.median(gaps), cadence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (the demo runs 4)")
    parser.add_argument("--every", type=int, default=0, help="0: the adaptive cadence; N: every N steps")
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for snapshots in (False, True):
            results[snapshots].append(run(args.steps, snapshots, args.nproc, args.every))
    for snapshots, runs in results.items():
        print(f"snapshots {'on ' if snapshots else 'off'}: step " + ", ".join(f"{s * 1e3:.1f}" for s, _, _ in runs)
              + " ms; step end to step end " + ", ".join(f"{g * 1e3:.1f}" for _, g, _ in runs) + " ms"
              + (f"; a snapshot every {', '.join(str(e) for _, _, e in runs)} step(s)" if snapshots else ""))
    on = statistics.median(g for _, g, _ in results[True])
    off = statistics.median(g for _, g, _ in results[False])
    print(f"per-step snapshots cost {100 * (on / off - 1):+.1f}% of a step (ratio {on / off:.3f}; target <= 1.05)")


if __name__ == "__main__":
    main()
