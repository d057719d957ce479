"""One rank of a test job for the replicated fast tier (tests/ett/checkpoints/test_snapshot_peers.py): ranks
made by plain processes over a file rendezvous, one rank a "node" (LOCAL_WORLD_SIZE=1), each
node's local folder `<base>/node-R`.

    python -m tests.ett.checkpoints.peer_ranks BASE RANK WORLD save STEPS   # snapshots steps 1..STEPS
    python -m tests.ett.checkpoints.peer_ranks BASE RANK WORLD restore     # prints {"step", "source", "value"}

$PEER_COPIES: how many peer nodes keep each snapshot (1 by default); $PEER_RENDEZVOUS: the file the
ranks meet at (a fresh one for each run of the ranks).

With `save`, each rank writes its receiver's address to `<base>/address-R` and waits for
`<base>/go` before it ends, so a test can try its receiver meanwhile.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ett.snapshots.tier import LocalSnapshots


def main() -> None:
    base, rank, world, mode = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{os.environ['PEER_RENDEZVOUS']}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    copies = int(os.environ.get("PEER_COPIES", "1"))  # each snapshot's copies, on the next nodes
    snapshots = LocalSnapshots(str(base / f"node-{rank}"), rank, world, every=1, replicate=True, group=group,
                               copies=copies)
    state = {"weights": torch.zeros(1000), "position": 0}
    if mode == "save":
        for step in range(1, int(sys.argv[5]) + 1):
            state["weights"].fill_(100 * rank + step)
            state["position"] = step
            snapshots.maybe_save(step, state)
            snapshots.wait()  # each one written and sent before the next: none passed over for a newer one
            assert snapshots.peers.flush(timeout=30)
        Path(base, f"address-{rank}").write_text(json.dumps(snapshots.peers._listener.getsockname()[:2]))
        deadline = time.monotonic() + 60
        while not Path(base, "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        step = snapshots.restore_step(group)
        if step is not None:
            snapshots.load(step, state)
        print(json.dumps({"step": step, "source": snapshots.restored_from, "value": state["weights"][0].item(),
                          "position": state["position"]}))
    dist.barrier(group)
    snapshots.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
