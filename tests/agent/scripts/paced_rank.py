"""A rank on the `ett` library stepping to a seeded pace, every rank alike (a gloo barrier ends
each step): each step --step-seconds +-25%, the first 3 steps 4x (warm-up), every 10th 2x. The
job's `slow` faults slow it further (tests/e2e/recovery/test_slow_time.py)."""

import argparse
import random
import time

import torch.distributed as dist

import ett

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--step-seconds", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=50)
args = parser.parse_args()

dist.init_process_group("gloo")
pace = random.Random(args.seed)  # the same seed on every rank: the same pace
with ett.init() as run:
    for step in range(1, args.steps + 1):
        seconds = args.step_seconds * pace.uniform(0.75, 1.25) * (4 if step <= 3 else 1) * (2 if step % 10 == 0 else 1)
        with run.step(step) as s:
            time.sleep(seconds)
            dist.barrier()
            s.loss = 1.0 / step
dist.destroy_process_group()
