"""Prints each checkpoint save and restore of a rank's event spool (ETT_EVENT_DIR) with its times:
a save's blocking part (ckpt_start to ckpt_staged: the training loop waits), split into the wait
for the previous save's commit (a save reuses its buffers) and its own staging, and its commit
(ckpt_staged to ckpt_committed: write, fsync, CRC-32s, marker); a restore's duration. bench/gpu_check.sh runs it after the trainer.

    python bench/gpu/ckpt_events.py /tmp/gpu-check-events/rank-0.jsonl
"""

import json
import sys


def main(path: str) -> None:
    started: dict[tuple, float] = {}  # (kind, step): a save starts before the last one commits
    staged: dict[int, float] = {}
    last_commit = 0.0
    for line in open(path):
        event = json.loads(line)
        kind, step, ts, data = event["kind"], event["step"], event["ts"], event["data"]
        if kind == "ckpt_start":
            started["ckpt", step] = ts
        elif kind == "restore_start":
            started["restore", None] = ts
        elif kind == "ckpt_staged":
            start = started["ckpt", step]
            ready = max(start, last_commit)
            staged[step] = ts
            print(f"  save of step {step}: the loop blocked {ts - start:.2f} s: {ready - start:.2f} s waiting for "
                  f"the previous commit, {ts - ready:.2f} s staging")
        elif kind == "ckpt_committed":
            last_commit = ts
            gib = data.get("bytes", 0) / 2**30
            seconds = ts - staged[step]
            print(f"  save of step {step}: committed {gib:.2f} GiB {seconds:.2f} s after staging ({gib / seconds:.2f} GiB/s)")
        elif kind == "ckpt_failed":
            print(f"  save of step {step} FAILED: {data.get('error')}")
        elif kind == "restore_end":
            print(f"  restore of step {step} from {data.get('source')}: {ts - started['restore', None]:.2f} s")


if __name__ == "__main__":
    main(sys.argv[1])
