"""A Lightning run resumed in the middle of an epoch, with ETT's ResumableDataLoader against a
plain DataLoader (examples/lightning.py under torchrun, 2 ranks on gloo, 12 batches an epoch).

For each loader: the run uninterrupted to --steps; the same run stopped at --stop-step (its last
step saved) and resumed from that checkpoint to --steps. Printed: whether the resumed run's final
parameters equal the uninterrupted run's bitwise, their largest difference, and which batches the
resumed run trained that the uninterrupted one did not (replayed) or never trained (skipped).

    .venv/bin/python bench/lightning_resume.py --steps 40 --stop-step 20
"""

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def run(folder: Path, name: str, steps: int, *args: str) -> tuple[dict, dict]:
    """The example to `steps`, checkpointing into folder/ckpt; its parameters and samples seen."""
    out, seen = folder / f"{name}.pt", folder / f"{name}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "examples" / "lightning.py"), "--steps", str(steps), "--checkpoint-dir",
               str(folder / "ckpt"), "--out", str(out), "--seen", str(seen), *args]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"{name}: exit {result.returncode}\n{result.stdout[-3000:]}")
    return torch.load(out), json.loads(seen.read_text())


def compare(steps: int, stop_step: int, *loader_args: str) -> dict:
    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as resumed:
        params, seen = run(Path(whole), "whole", steps, *loader_args)
        run(Path(resumed), "first", stop_step, *loader_args)
        params_r, seen_r = run(Path(resumed), "second", steps, *loader_args)
    expected = Counter(tuple(s) for s in seen["samples"][stop_step:])
    got = Counter(tuple(s) for s in seen_r["samples"])
    return {
        "bitwise": all(torch.equal(params[k], params_r[k]) for k in params),
        "max_abs_diff": max((params[k] - params_r[k]).abs().max().item() for k in params),
        "replayed": sum((got - expected).values()),
        "skipped": sum((expected - got).values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stop-step", type=int, default=20, help="a step inside an epoch (12 batches each)")
    args = parser.parse_args()
    print(f"resumed at step {args.stop_step} of {args.steps} (epoch {args.stop_step // 12}, "
          f"batch {args.stop_step % 12} of 12)")
    print(f"{'loader':<22} {'bitwise':>8} {'max |diff|':>12} {'replayed':>9} {'skipped':>8}")
    for name, loader_args in (("ResumableDataLoader", ()), ("plain DataLoader", ("--plain-loader",))):
        r = compare(args.steps, args.stop_step, *loader_args)
        print(f"{name:<22} {r['bitwise']!s:>8} {r['max_abs_diff']:>12.3g} {r['replayed']:>9} {r['skipped']:>8}")


if __name__ == "__main__":
    main()
