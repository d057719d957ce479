"""Stragglers (issue #36): the same job with one rank slowed at mid-run, under `report` and under
`replace`, side by side in one run; and what per-rank timing costs a step.

1. A live service and three real agents of one slot (tests/support/cluster.py), the job
   examples/plain_ddp.py on 2 nodes x 1 rank (DDP over gloo), `--step-seconds` standing for the
   step's compute; rank 1 slowed `--factor` times from the middle step on (the `slow` fault).
   `report` runs it to the end on the same nodes; `replace` stops it, restarts on the spare and
   runs it to the end. Wall time (first allocation to finish) and ETT of each, and the ratio.
2. Per-rank timing alone: a DDP loop, then an FSDP2 loop (fully_shard blocks), on two local ranks
   (torch.multiprocessing, gloo), the same steps in a job's environment with per-rank timing (the
   DDP hook, the timed waits on collectives, the windows) and without it (the Run's other work, its
   events, alike in both), in alternating order, the median step of each; and the Run's own CPU
   time a step, and a timed wait's (issue #50: under 1% of a step).

    .venv/bin/python bench/stragglers.py --steps 120 --factor 2
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from tests.support.cluster import cluster, example_job  # noqa: E402


def run_policy(policy: str, args) -> dict:
    slow = {"attempt": 0, "rank": 1, "at_step": args.steps // 2, "action": "slow", "factor": args.factor}
    spec = example_job("plain_ddp.toml", name=f"bench-{policy}", stragglers=policy, max_restarts=2, faults=[slow],
                       entrypoint=["python", "examples/plain_ddp.py", "--steps", str(args.steps),
                                   "--step-seconds", str(args.step_seconds)])  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=f"ett-bench-{policy}-") as root, cluster(Path(root)) as c:
        for name in ("node-a", "node-b", "node-spare"):
            c.start_agent(name, slots=1)
        job = c.wait_job(c.submit(**spec), timeout=900)
        report = c.report(job["id"])
    return {"state": job["state"], "attempts": len(job["attempts"]), "wall": report["wall_seconds"],
            "ett": report["ett_percent"], "full_speed": report["full_speed_percent"],
            "slow": report["slow_seconds"], "flags": report["stragglers"]}


class _NoClock:
    """The Run's SyncClock with nothing timed: no step span, no timed waits."""

    def __init__(self, time_waits: bool = False) -> None:
        pass

    def begin(self) -> None:
        pass

    def mark(self) -> None:
        pass

    def end(self) -> None:
        return None

    def stop(self) -> None:
        pass


def _mlp(nn, width: int = 512):
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def _timing_worker(rank: int, world: int, port: int, steps: int, timed: bool, out: str, kind: str = "ddp") -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import ett

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    # Both in a job's environment (events written alike); without timing, the Run gets neither
    # the DDP hook nor the windows: what per-rank timing alone costs.
    os.environ.update(ETT_JOB_ID="bench", ETT_ATTEMPT="0", ETT_EVENT_DIR=f"{out}.events-{rank}")
    if not timed:
        import ett.run

        ett.run.DDPWatch = lambda clock: None
        ett.run.TimingWindow = lambda emit: None
        ett.run.SyncClock = _NoClock
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if kind == "ddp":
        model = DistributedDataParallel(_mlp(nn))
    else:  # 4 blocks of half the DDP model's width, each its own FSDP2 unit (its all-gathers, its reduce-scatter)
        torch.manual_seed(0)
        model = nn.Sequential(*[_mlp(nn, 256) for _ in range(4)])
        for block in model:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(128, 512 if kind == "ddp" else 256)
    durations, waits_seen = [], 0
    with ett.init() as run:
        for step in range(1, steps + 1):
            start = time.perf_counter()
            with run.step(step):
                loss = model(inputs).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if timed:  # the waits on collectives timed in this step
                    waits_seen = len(run._sync.span.waits)
            durations.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(str(statistics.median(durations[10:])))
    if timed and rank == 0:
        Path(f"{out}.waits").write_text(str(waits_seen))
    dist.barrier()
    dist.destroy_process_group()


def own_cost_per_step(steps: int = 20000) -> tuple[float, float]:
    """The Run's own CPU time per step in a job's environment (one process, no DDP, an empty step),
    without per-rank timing and with it (a step span, a mark in every step, the windows): microseconds each."""
    import ett
    import ett.run
    from ett.timing import SyncClock, TimingWindow

    costs = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(ETT_JOB_ID="bench", ETT_ATTEMPT="0", ETT_EVENT_DIR=tmp)
        for timed in (False, True):
            ett.run.TimingWindow = TimingWindow if timed else (lambda emit: None)
            ett.run.SyncClock = SyncClock if timed else _NoClock
            with ett.init() as run:
                start = time.process_time()
                for step in range(1, steps + 1):
                    with run.step(step) as s:
                        if timed:
                            s.synchronizing()
                costs.append((time.process_time() - start) / steps * 1e6)
        ett.run.TimingWindow, ett.run.SyncClock = TimingWindow, SyncClock
        for name in ("ETT_JOB_ID", "ETT_ATTEMPT", "ETT_EVENT_DIR"):
            del os.environ[name]
    return costs[0], costs[1]


def timed_wait_cost(waits: int = 20000) -> tuple[float, float]:
    """CPU time of one wait on a collective (a one-rank gloo group's all-reduce of one number),
    inside a step of a Run timing its waits and without: microseconds each."""
    import torch
    import torch.distributed as dist

    from ett.timing import SyncClock

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29499")
    dist.init_process_group("gloo", rank=0, world_size=1)
    one, costs = torch.ones(1), []
    for timed in (False, True):
        clock = SyncClock(time_waits=timed)
        clock.begin()
        start = time.process_time()
        for _ in range(waits):
            dist.all_reduce(one)
        costs.append((time.process_time() - start) / waits * 1e6)
        clock.end()
        clock.stop()
    dist.destroy_process_group()
    return costs[0], costs[1]


def timing_overhead(rounds: int, steps: int, kind: str = "ddp") -> tuple[list[tuple[float, float]], int]:
    import torch.multiprocessing as mp

    pairs, waits = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            medians = {}
            for timed in ((False, True) if i % 2 == 0 else (True, False)):  # neither always first
                out = f"{tmp}/median-{i}-{timed}"
                mp.start_processes(_timing_worker, args=(2, 29500 + 2 * i + timed, steps, timed, out, kind), nprocs=2,
                                   start_method="spawn")
                medians[timed] = float(Path(out).read_text())
                if timed:
                    waits = int(Path(f"{out}.waits").read_text())
            pairs.append((medians[False], medians[True]))
    return pairs, waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the timing overhead measurement")
    parser.add_argument("--timing-steps", type=int, default=300)
    parser.add_argument("--timing-only", action="store_true", help="only the timing overhead")
    args = parser.parse_args()

    if args.timing_only:
        return print_overhead(args)
    results = {policy: run_policy(policy, args) for policy in ("report", "replace")}
    print(f"plain_ddp, 2 ranks, {args.steps} steps of {args.step_seconds} s, rank 1 slowed {args.factor}x from step "
          f"{args.steps // 2}")
    print(f"  {'policy':8} {'state':10} {'attempts':>8} {'wall s':>8} {'ETT %':>6} {'full %':>6} {'slow s':>7}  flag")
    for policy, r in results.items():
        flag = r["flags"][0] if r["flags"] else None
        said = "-"
        if flag:
            said = f"rank {flag['rank']} on {flag['node']} at step {flag['flagged_step']}, {flag['action']}"
            said += f": {flag['reason']}" if flag.get("reason") else ""  # why `replace` kept it where it ran
        print(f"  {policy:8} {r['state']:10} {r['attempts']:>8} {r['wall']:>8.1f} {r['ett']:>6.1f} "
              f"{r['full_speed']:>6.1f} {r['slow']:>7.1f}  {said}")
    print(f"  replace / report: wall {results['replace']['wall'] / results['report']['wall']:.2f}x")

    print_overhead(args)


def print_overhead(args) -> None:
    without, with_timing = own_cost_per_step()
    print(f"the Run's own CPU time a step (20,000 empty steps, in a job): {without:.1f} us without per-rank "
          f"timing, {with_timing:.1f} us with it: +{with_timing - without:.1f} us a step")
    plain, timed_wait = timed_wait_cost()
    print(f"a wait on a collective (one-rank gloo all-reduce), CPU time: {plain:.1f} us untimed, {timed_wait:.1f} us "
          f"timed: +{timed_wait - plain:.1f} us a wait")
    for kind in ("ddp", "fsdp2"):
        pairs, waits = timing_overhead(args.rounds, args.timing_steps, kind)
        print(f"per-rank timing, {kind} on 2 gloo ranks, median step of {args.timing_steps} (10 warm-up left out)"
              f", {waits} timed waits a step:")
        for none, timed in pairs:
            print(f"  none {1000 * none:.3f} ms  timed {1000 * timed:.3f} ms  ({100 * (timed / none - 1):+.1f}%)")
        ratios = sorted(timed / none for none, timed in pairs)
        step = statistics.median(none for none, _ in pairs)
        own = (with_timing - without + waits * (timed_wait - plain)) / 1e6
        print(f"  median ratio {statistics.median(ratios):.4f}; the timing's own CPU time a step "
              f"{own * 1e6:.1f} us: {100 * own / step:.3f}% of the {1000 * step:.1f} ms step")


if __name__ == "__main__":
    main()
