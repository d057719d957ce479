"""Why 64 experts do not fit on one rank, and fit on four: the same MoE model and training step
under the same real memory cap per rank, first on 1 rank, then on 4 ranks with expert
parallelism (each rank holds 16 experts) and ZeRO-3 (dense weights, gradients and Adam moments
sharded).

    .venv/bin/python bench/moe_memory.py                      # 64 experts, cap 600 MiB per rank
    .venv/bin/python bench/moe_memory.py --experts 16 --dim 128 --hidden 256 --cap-mib 40   # small

The cap is the kernel's, not arithmetic: each rank, once torch and its process group are up,
sets RLIMIT_DATA (private writable memory: every tensor, malloc'd or mmap'd) to what it uses then
plus --cap-mib. The model is built on the meta device and materialised only after sharding, so
no rank ever holds the whole model unless it is alone. Each configuration trains --steps AdamW
steps; a rank that cannot allocate reports its out-of-memory error. Printed: each configuration's
outcome and peak resident bytes per rank (ru_maxrss; in brackets, what was added after torch and
the process group were up), then one line `64 experts: ...`; exit 0 when
one rank ran out of memory and four ranks trained.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER_FLAG = "--worker"
RESULTS_ENV = "MOE_MEMORY_RESULTS"  # the folder where each rank writes its result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512, help="each expert's hidden size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--cap-mib", type=int, default=600, help="memory each rank may add once started")
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the sharded configuration")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def status_bytes(field: str) -> int:
    """A /proc/self/status figure: VmData (private writable memory, what RLIMIT_DATA counts), VmRSS."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1]) * 1024


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: cap, build sharded, train, report one JSON line."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from trainer.model import ModelConfig, Transformer
    from trainer.moe import MoEConfig
    from trainer.parallel import ParallelConfig, build_mesh, build_optimizer, parallelize

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model_cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=64)
    moe_cfg = MoEConfig(num_experts=args.experts, top_k=2, expert_hidden_dim=args.hidden, capacity_factor=1.25)
    parallel = ParallelConfig(ep=world, zero=3, mixed_precision="none")
    mesh = build_mesh(parallel, world, "cpu")
    tokens_BT = torch.randint(0, model_cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(rank))
    started_rss = status_bytes("VmRSS")  # torch and the process group: the same for every configuration
    cap = status_bytes("VmData") + args.cap_mib * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    outcome, error = "trained", ""
    try:
        with torch.device("meta"):
            model = Transformer(model_cfg, moe_cfg)
        model = parallelize(model, mesh, parallel)
        model.to_empty(device="cpu")
        model.init_weights()
        optimizer = build_optimizer(model, parallel, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
        for _ in range(args.steps):
            logits_BTV, aux = model(tokens_BT[:, :-1])
            loss = F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten()) + aux
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except (RuntimeError, MemoryError) as exc:  # the allocator's "can't allocate memory", or Python's
        outcome, error = "out of memory", str(exc).splitlines()[0][:200]
        if "alloc" not in error.lower() and not isinstance(exc, MemoryError):
            raise
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"rank": rank, "world": world, "outcome": outcome, "error": error, "peak_bytes": peak,
              "peak_added_bytes": peak - started_rss}
    Path(os.environ[RESULTS_ENV], f"rank-{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a rank that ran out of memory must not hang the group's teardown


def run_config(args: argparse.Namespace, ranks: int) -> list[dict]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            str(Path(__file__).resolve()), WORKER_FLAG, *sys.argv[1:]]
    with tempfile.TemporaryDirectory() as results:
        # One thread and two malloc arenas per rank: no per-thread pools or arenas in the figures.
        env = os.environ | {"OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", RESULTS_ENV: results}
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        found = [json.loads(p.read_text()) for p in sorted(Path(results).glob("rank-*.json"))]
    if len(found) != ranks:
        sys.exit(f"moe_memory: {ranks} rank(s) reported {len(found)} results (exit {done.returncode}):\n"
                 + done.stderr[-3000:])
    return sorted(found, key=lambda r: r["rank"])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    expert_bytes = args.layers * args.experts * 3 * args.dim * args.hidden * 4
    print(f"{args.experts} experts x {args.layers} layers, dim {args.dim}, expert hidden {args.hidden}: expert "
          f"weights {expert_bytes / 2**20:.0f} MiB fp32 (x4 with gradients and Adam moments); cap "
          f"{args.cap_mib} MiB per rank")
    outcomes = {}
    for ranks, label in ((1, "1 rank"), (args.ranks, f"{args.ranks} ranks, EP {args.ranks} + ZeRO-3")):
        results = run_config(args, ranks)
        outcomes[ranks] = {r["outcome"] for r in results}
        peaks = ", ".join(f"{r['peak_bytes'] / 2**20:.0f} ({r['peak_added_bytes'] / 2**20:+.0f})" for r in results)
        print(f"  {label:28} {'/'.join(sorted(outcomes[ranks])):14} peak resident MiB per rank "
              f"(added after start-up): {peaks}")
        for r in results:
            if r["error"]:
                print(f"    rank {r['rank']}: {r['error']}")
    holds = outcomes[1] == {"out of memory"} and outcomes[args.ranks] == {"trained"}
    print(f"{args.experts} experts: {'do not fit' if outcomes[1] == {'out of memory'} else 'fit'} on 1 rank, "
          f"{'train' if outcomes[args.ranks] == {'trained'} else 'do not train'} on {args.ranks} ranks under "
          f"{args.cap_mib} MiB each{'' if holds else ' (the claim does not hold at these sizes)'}")
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
