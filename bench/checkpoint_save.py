"""Checkpoint save of a ~1 GB training state: how long the training loop is blocked by the
trainer's asynchronous save (trainer.checkpoint.Checkpointer: staging to CPU memory, then DCP
writes in the background) against a synchronous DCP save of the same state, in one run.

    python bench/checkpoint_save.py [--dir /tmp/ckpt-bench] [--reps 3]

The state is the trainer's own: a Transformer with MoE layers (~82M parameters) and its AdamW
moments, 12 bytes per parameter. Every save is fsynced. The saves are interleaved (synchronous,
process-based, thread-based, repeated) so all see the same load on a shared machine; the first
async save of a mode also allocates its staging buffers (and starts the checkpoint process), so
its blocking time is reported apart.
"""

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from trainer.checkpoint import CheckpointConfig, Checkpointer, ModelOptimizerState, TrainProgress
from trainer.events import EventWriter
from trainer.model import ModelConfig, Transformer
from trainer.moe import MoEConfig
from trainer.parallel import ParallelConfig, build_mesh, build_optimizer, parallelize
from trainer.train import init_distributed

MODEL = ModelConfig(dim=512, n_layers=6, n_heads=8, max_seq_len=128)
MOE = MoEConfig(num_experts=8, top_k=2, expert_hidden_dim=1024)


def build_state() -> dict:
    torch.manual_seed(0)
    model = Transformer(MODEL, MOE)
    model.init_weights()
    parallel = ParallelConfig(ep=1, zero=3)
    model = parallelize(model, build_mesh(parallel, 1, "cpu"), parallel)
    optimizer = build_optimizer(model, parallel, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    tokens_BT = torch.randint(0, 256, (2, 64))
    logits_BTV, aux_loss = model(tokens_BT)
    (logits_BTV.float().logsumexp(-1).mean() + aux_loss).backward()
    optimizer.step()  # creates the Adam moments
    return {"app": ModelOptimizerState(model, optimizer), "progress": TrainProgress()}


def state_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/ett-ckpt-bench")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    init_distributed()
    state = build_state()

    # Interleaved, so that the three see the same load on a shared machine.
    modes = ("process", "thread")
    checkpointers = {mode: Checkpointer(CheckpointConfig(dir=str(root / mode), keep=1, async_mode=mode),
                                        EventWriter(None, 0, 0), state["app"].model) for mode in modes}
    sync_s, blocking_s, commit_s = [], {mode: [] for mode in modes}, {mode: [] for mode in modes}
    for rep in range(args.reps + 1):
        start = time.perf_counter()
        dcp.save(state, storage_writer=FileSystemWriter(root / "sync", sync_files=True, overwrite=True))
        sync_s.append(time.perf_counter() - start)
        for mode, checkpointer in checkpointers.items():
            start = time.perf_counter()
            checkpointer.save(rep + 1, state)
            blocking_s[mode].append(time.perf_counter() - start)
            checkpointer.wait()
            commit_s[mode].append(time.perf_counter() - start)
    for checkpointer in checkpointers.values():
        checkpointer.close()

    sync = statistics.median(sync_s)
    print(f"state: {state_bytes(root / 'sync') / 1e9:.2f} GB; synchronous DCP save: median {sync:.2f} s "
          f"({', '.join(f'{s:.2f}' for s in sync_s)})")
    for mode in modes:
        # The first save of a mode also allocates its staging buffers (and starts the checkpoint process).
        steady = statistics.median(blocking_s[mode][1:])
        print(f"async {mode}: blocking first {blocking_s[mode][0]:.3f} s, then median {steady:.3f} s "
              f"({', '.join(f'{s:.3f}' for s in blocking_s[mode][1:])}); save to commit median "
              f"{statistics.median(commit_s[mode][1:]):.2f} s; blocking / synchronous = {100 * steady / sync:.1f}%")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
