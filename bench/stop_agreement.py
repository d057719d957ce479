"""What `run.should_stop()` (called by `run.checkpoint` at every step inside a job) costs: one
one-number all-reduce, so that every rank stops after the same step when SIGTERM reaches only
some. Per call; a step of the loop pays it once.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 bench/stop_agreement.py [--calls 5000]

Rank 0 prints microseconds per call (median of 5 rounds) and the share of a step of
--step-ms milliseconds that is.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch.distributed as dist

import ett


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=100.0, help="a step to compare with")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    folder = tempfile.mkdtemp(prefix="ett-stop-bench-")
    os.environ.update({"ETT_JOB_ID": "bench", "ETT_ATTEMPT": "0", "ETT_CHECKPOINT_DIR": folder})
    run = ett.init()
    assert run._handles_sigterm, "the run must be inside a job with a checkpoint folder"
    per_call = []
    for _ in range(args.rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            run.should_stop()
        per_call.append((time.perf_counter() - start) / args.calls)
    if dist.get_rank() == 0:
        us = 1e6 * statistics.median(per_call)
        print(f"{dist.get_world_size()} ranks, gloo: should_stop {us:.1f} us a call (median of {args.rounds} rounds "
              f"of {args.calls}); {100 * us / (1000 * args.step_ms):.3f}% of a {args.step_ms:g} ms step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
