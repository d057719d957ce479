"""A rank written against the `ett` library (no model): what the agent sees of a script's run.

--env-file F: rank 0 writes the ETT_* environment it was handed to F (JSON).
--busy-seconds S: S seconds of work before the first step, marked with run.progress() every 0.2 s
(or, with --silent, not marked at all).
--stall-at-step S --stall KIND[,KIND] --stall-seconds X: in step S (0: as soon as ett.init() returns) rank 1 (or, with two kinds,
rank 0 the first and rank 1 the second) stops itself (freeze: SIGSTOP), or for X seconds sleeps
(sleep: slow but live), computes holding the GIL (spin: its library's thread cannot pulse
meanwhile, but its CPU time goes up) or waits in C code holding the GIL (block: libc's sleep through
ctypes.PyDLL, which keeps the GIL: frozen, though not stopped).
"""

import argparse
import ctypes
import json
import math
import os
import signal
import time

import ett

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--env-file", default=None)
parser.add_argument("--busy-seconds", type=float, default=0.0)
parser.add_argument("--silent", action="store_true")
parser.add_argument("--stall-at-step", type=int, default=None)
parser.add_argument("--stall", default="freeze")
parser.add_argument("--stall-seconds", type=float, default=2.0)
args = parser.parse_args()


STALLS = dict(enumerate(args.stall.split(","))) if "," in args.stall else {1: args.stall}


def stall(kind: str) -> None:
    if kind == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "sleep":
        time.sleep(args.stall_seconds)
    elif kind == "block":
        ctypes.PyDLL(None).sleep(math.ceil(args.stall_seconds))
    else:  # spin: one C call the interpreter cannot switch threads in, sized from a short one
        start = time.perf_counter()
        sum(range(1_000_000))
        sum(range(int(1_000_000 * args.stall_seconds / (time.perf_counter() - start))))

with ett.init() as run:
    if args.stall_at_step == 0 and run.rank in STALLS:  # at once, before the library's thread may have run
        stall(STALLS[run.rank])
    if args.env_file and run.rank == 0:
        with open(args.env_file, "w") as f:
            json.dump({k: v for k, v in os.environ.items() if k.startswith("ETT_")}, f)
    with run.initializing():
        busy_until = time.monotonic() + args.busy_seconds
        while time.monotonic() < busy_until:
            time.sleep(0.2)
            if not args.silent:
                run.progress()
    for step in range(1, args.steps + 1):
        with run.step(step, tokens=64) as s:
            time.sleep(0.05)
            if step == args.stall_at_step and run.rank in STALLS:
                stall(STALLS[run.rank])
            s.loss = 1.0 / step
