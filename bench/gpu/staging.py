"""Checkpoint staging of a GPU state into reused host buffers, pageable against pinned: GB/s of
the device-to-host copy a save blocks on, and the first save's cost (allocating and pinning the
buffers, once per attempt) apart (bench/gpu_check.sh, section 3).

    python bench/gpu/staging.py [--gib 1]
"""

import argparse
import time

import torch

from ett.checkpoints.staging import ReusedBufferStager


def timed_stage(stager: ReusedBufferStager, state: dict) -> tuple[float, dict]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    staged = stager.stage(state).result()
    return time.perf_counter() - start, staged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=int, default=1)
    args = parser.parse_args()
    state = {f"w{i}": torch.randn(64, 1024, 1024, device="cuda") for i in range(4 * args.gib)}  # 256 MiB each
    nbytes = sum(t.nbytes for t in state.values())
    for pinned in (False, True):
        stager = ReusedBufferStager(share_memory=False, pin_memory=pinned)
        first, _ = timed_stage(stager, state)
        times = []
        for _ in range(5):
            seconds, staged = timed_stage(stager, state)
            times.append(seconds)
        assert all(torch.equal(staged[k], state[k].cpu()) for k in state)
        seconds = sorted(times)[len(times) // 2]
        print(f"  {args.gib} GiB, {'pinned' if pinned else 'pageable'} buffers: {nbytes / seconds / 1e9:.1f} GB/s "
              f"({seconds * 1e3:.0f} ms, median of 5); the first, allocating the buffers: {first:.2f} s")
        stager.close()


if __name__ == "__main__":
    main()
