"""What `import ett` costs a training loop: the time `with run.step(...)` adds to a step, inside a
job (events and progress marks written) and outside one (inert), against a bare loop; and the
blocking time of `run.checkpoint` for a state of a given size.

    .venv/bin/python bench/library_overhead.py [--steps 20000] [--state-mib 64]

Prints microseconds per step for each variant and their differences from the bare loop, then
the blocking seconds of a save (the call to its return) against a synchronous DCP save of the
same state (same files, fsynced, written before it returns).
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

import ett


def loop(run: ett.Run | None, steps: int) -> float:
    """Seconds per step of an empty step body, with or without the run's step context."""
    start = time.perf_counter()
    if run is None:
        for _ in range(1, steps + 1):
            pass
    else:
        for step in range(1, steps + 1):
            with run.step(step, tokens=1024) as s:
                s.loss = 1.0
    return (time.perf_counter() - start) / steps


def step_overhead(steps: int, reps: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        results: dict[str, list[float]] = {"bare": [], "outside a job": [], "inside a job": []}
        for rep in range(reps):
            results["bare"].append(loop(None, steps))
            with ett.init() as run:
                results["outside a job"].append(loop(run, steps))
            os.environ.update({"ETT_JOB_ID": "bench", "ETT_ATTEMPT": str(rep), "ETT_EVENT_DIR": f"{root}/{rep}"})
            with ett.init() as run:
                results["inside a job"].append(loop(run, steps))
            for name in ("ETT_JOB_ID", "ETT_ATTEMPT", "ETT_EVENT_DIR"):
                del os.environ[name]
    bare = statistics.median(results["bare"])
    for name, seconds in results.items():
        median = statistics.median(seconds)
        print(f"{name:14s} {median * 1e6:8.2f} us/step  (+{(median - bare) * 1e6:6.2f} us over the bare loop)")


def checkpoint_blocking(state_mib: int, reps: int, gap_seconds: float) -> None:
    """`gap_seconds` between saves stands for the training steps between them: the previous save's
    background write is done when the next one starts, as it is in a loop saving every N steps."""
    state = {"weights": torch.randn(state_mib << 18)}  # 4-byte floats
    with tempfile.TemporaryDirectory() as root:
        blocking, synchronous = [], []
        with ett.init(checkpoint_dir=f"{root}/ckpt", keep=1) as run:
            for step in range(1, reps + 2):
                start = time.perf_counter()
                run.checkpoint(step, state, force=True)
                blocking.append(time.perf_counter() - start)
                time.sleep(gap_seconds)
                start = time.perf_counter()
                dcp.save(state, checkpoint_id=f"{root}/sync-{step}")  # the same files, written before returning
                synchronous.append(time.perf_counter() - start)
                shutil.rmtree(f"{root}/sync-{step}")
        first, blocking = blocking[0], blocking[1:]  # the first save allocates its staging buffers
        block, sync = statistics.median(blocking), statistics.median(synchronous)
        print(f"checkpoint of {state_mib} MiB: run.checkpoint blocks {block:.4f} s (the first: {first:.4f} s), "
              f"a synchronous dcp.save takes {sync:.4f} s: {sync / block:.1f}x (medians of {reps})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--state-mib", type=int, default=64)
    parser.add_argument("--gap-seconds", type=float, default=1.0)
    args = parser.parse_args()
    step_overhead(args.steps, args.reps)
    checkpoint_blocking(args.state_mib, args.reps, args.gap_seconds)


if __name__ == "__main__":
    main()
