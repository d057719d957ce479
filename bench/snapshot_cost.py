"""What the fast tier costs a training step: the same cpu-demo run (EP 2, ZeRO-3; 2 ranks, or 4 as
in `ett demo`) without snapshots, with local snapshots (ett/snapshots/tier.py) and with them replicated
to the peer node (ett/snapshots/peers.py), and kept by the next two nodes (`snapshot_copies = 2`,
three nodes or more), alternated, median step time of each.

    .venv/bin/python bench/snapshot_cost.py [--steps 40] [--rounds 2] [--nproc 2] [--every 0] [--nodes 2]
    .venv/bin/python bench/snapshot_cost.py --shapes 2:2,4:4   # both shapes, one and two copies, alternated

The ranks run as `--nodes` torchrun "nodes" on this machine (static rendezvous on loopback), each
with a node-local folder of its own, so the replicated mode sends each snapshot to the other
node's rank over TCP as it would between machines; `--nodes 1` runs one torchrun and leaves the
replicated mode out. `--every 0` lets the fast tier choose its cadence (every step its cost
allows); `--every 1` snapshots after every step whatever it costs. Prints each run's median step
time (rank 0's `step` events, which end before the snapshot), the median time between step ends
(which includes it), the cadence rank 0 settled on (from its log), and the ratio of the time
between step ends of each mode to no snapshots: the target is at most 1.05 (issues #21, #38).
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {"off": ["--checkpoint.snapshots", "false"],
         "local": ["--checkpoint.snapshots", "true", "--checkpoint.snapshot_peers", "false"],
         "replicated": ["--checkpoint.snapshots", "true", "--checkpoint.snapshot_peers", "true"],
         # Each snapshot kept by the next two nodes (checkpoint.snapshot_copies): three nodes at least.
         "replicated-x2": ["--checkpoint.snapshots", "true", "--checkpoint.snapshot_peers", "true",
                           "--checkpoint.snapshot_copies", "2"]}  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(steps: int, mode: str, nproc: int, every: int, nodes: int) -> tuple[float, float, int]:
    """Median step time, median time between step ends, and rank 0's last snapshot cadence."""
    with tempfile.TemporaryDirectory() as root:
        env = os.environ | {"ETT_EVENT_DIR": f"{root}/events", "OMP_NUM_THREADS": "1"}
        port, launched = free_port(), []
        for node in range(nodes):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
                    "--nproc-per-node", str(nproc // nodes), "--master-addr", "127.0.0.1", "--master-port", str(port),
                    "-m", "trainer.train", "--preset", "cpu-demo", "--train.steps", str(steps),
                    "--checkpoint.dir", f"{root}/ckpt", "--checkpoint.local_dir", f"{root}/local-{node}",
                    "--checkpoint.interval_steps", "1000", *MODES[mode], "--checkpoint.snapshot_every", str(every)]
            launched.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                             text=True))
        output = launched[0].communicate()[0]
        for process in launched[1:]:
            process.communicate()
        if any(process.returncode for process in launched):
            sys.exit(f"{mode}: a torchrun failed; node 0's output ends:\n{output[-3000:]}")
        events = [json.loads(line) for line in Path(root, "events", "rank-0.jsonl").read_text().splitlines()]
    steps_ = [e for e in events if e["kind"] == "step"][5:]  # past the warm-up
    gaps = [b["ts"] - a["ts"] for a, b in zip(steps_, steps_[1:])]
    # The cadence the fast tier ended on (rank 0 logs each change, ett/snapshots/tier.py): 1 is every step.
    changes = [int(m) for m in re.findall(r"local snapshots every (\d+) steps", output)]
    cadence = changes[-1] if changes else every or 1
    return statistics.median(e["data"]["duration"] for e in steps_), statistics.median(gaps), cadence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2, help="ranks in all (the demo runs 4)")
    parser.add_argument("--every", type=int, default=0, help="0: the adaptive cadence; N: every N steps")
    parser.add_argument("--nodes", type=int, default=2, help="torchrun nodes the ranks are split over")
    parser.add_argument("--shapes", default=None,
                        help="shapes run side by side, e.g. 2:2,4:4 (ranks:nodes); in place of --nproc, --nodes")
    args = parser.parse_args()
    shapes = ([tuple(map(int, shape.split(":"))) for shape in args.shapes.split(",")] if args.shapes
              else [(args.nproc, args.nodes)])
    if any(nproc % nodes for nproc, nodes in shapes):
        parser.error("the ranks must be a multiple of the nodes")
    # Replication needs two nodes, two copies three.
    results: dict[tuple[int, int, str], list[tuple[float, float, int]]] = {
        (nproc, nodes, mode): [] for nproc, nodes in shapes for mode in MODES
        if (mode != "replicated" or nodes > 1) and (mode != "replicated-x2" or nodes > 2)}
    for _ in range(args.rounds):
        for nproc, nodes, mode in results:
            results[nproc, nodes, mode].append(run(args.steps, mode, nproc, args.every, nodes))
    for (nproc, nodes, mode), runs in results.items():
        print(f"{nproc} ranks on {nodes} nodes, snapshots {mode:13}: step "
              + ", ".join(f"{s * 1e3:.1f}" for s, _, _ in runs) + " ms; step end to step end " + ", ".join(f"{g * 1e3:.1f}" for _, g, _ in runs) + " ms"
              + (f"; a snapshot every {', '.join(str(e) for _, _, e in runs)} step(s)" if mode != "off" else ""))
    for (nproc, nodes, mode), runs in results.items():
        if mode != "off":
            off = statistics.median(g for _, g, _ in results[nproc, nodes, "off"])
            on = statistics.median(g for _, g, _ in runs)
            print(f"{nproc} ranks on {nodes} nodes: {mode} snapshots cost {100 * (on / off - 1):+.1f}% of a step "
                  f"(ratio {on / off:.3f}; target <= 1.05)")


if __name__ == "__main__":
    main()
