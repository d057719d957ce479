"""Checkpoint save of a ~1 GB training state: the time the training loop loses to the trainer's
asynchronous save (ett.checkpoint.Checkpointer) against a synchronous DCP save of the same
state, in one run.

    python bench/checkpoint_save.py [--dir /tmp/ett-ckpt-bench] [--reps 4] [--batch 2]

The state is the trainer's own: a Transformer with MoE layers (~82M parameters) and its AdamW
moments, 12 bytes per parameter. Every save is fsynced. Each save is followed by a real training
step of that model (forward and backward, `wait_for_staging`, `optimizer.step`), as in
trainer/train.py. Per async mode (process-based, thread-based), two ways:

- overlapped (the trainer's way): `save` copies buffers and small state, and the parameters and
  Adam moments are copied in the background during the step's forward and backward. Blocking =
  time in `save` + time in `wait_for_staging`.
- staged inside save (the baseline, the trainer before the overlap): `save` then
  `wait_for_staging` at once, before the step. Blocking = the two.

The step after a save also shares the 2 cores with the copy thread and DCP's write: "slowdown"
is that step's wall time less the wall time of the step just before the save (nothing in flight:
the previous save is committed), and "lost" is blocking + slowdown, per save. Saves are
interleaved so that all see the same load; the first async save of a mode (buffer allocation,
checkpoint process start) is left out of the medians and printed apart.
"""

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemWriter

from ett.checkpoint import CheckpointConfig, Checkpointer
from ett.events import EventWriter
from ett.state import ModelOptimizerState, TrainProgress
from trainer.model import ModelConfig, Transformer
from trainer.moe import MoEConfig
from trainer.parallel import ParallelConfig, build_mesh, build_optimizer, parallelize
from trainer.train import init_distributed

MODEL = ModelConfig(dim=512, n_layers=6, n_heads=8, max_seq_len=128)
MOE = MoEConfig(num_experts=8, top_k=2, expert_hidden_dim=1024)
WAYS = ("overlapped", "staged inside save")


def build_state() -> dict:
    torch.manual_seed(0)
    model = Transformer(MODEL, MOE)
    model.init_weights()
    parallel = ParallelConfig(ep=1, zero=3)
    model = parallelize(model, build_mesh(parallel, 1, "cpu"), parallel)
    optimizer = build_optimizer(model, parallel, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    return {"app": ModelOptimizerState(model, optimizer), "progress": TrainProgress()}


def train_step(app: ModelOptimizerState, tokens_BT: torch.Tensor, checkpointer: Checkpointer | None) -> tuple[float, float]:
    """One step of trainer/train.py's loop; returns (time in wait_for_staging, step wall time)."""
    start = time.perf_counter()
    logits_BTV, aux_loss = app.model(tokens_BT[:, :-1])
    (F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten()) + aux_loss).backward()
    waited = time.perf_counter()
    if checkpointer is not None:
        checkpointer.wait_for_staging()
    waited = time.perf_counter() - waited
    app.optimizer.step()
    app.optimizer.zero_grad(set_to_none=True)
    return waited, time.perf_counter() - start


def median_ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.0f} ms"


def each_ms(values: list[float]) -> str:
    return ", ".join(f"{1000 * value:.0f}" for value in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/ett-ckpt-bench")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="sequences of 128 tokens per training step")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    init_distributed()
    state = build_state()
    app = state["app"]
    tokens_BT = torch.randint(0, MODEL.vocab_size, (args.batch, MODEL.max_seq_len + 1))
    train_step(app, tokens_BT, None)  # creates the Adam moments

    modes = ("process", "thread")
    checkpointers = {mode: Checkpointer(CheckpointConfig(dir=str(root / mode), keep=1, async_mode=mode),
                                        EventWriter(None, 0, 0)) for mode in modes}
    sync_s = []
    blocking_s = {(mode, way): [] for mode in modes for way in WAYS}
    slowdown_s = {key: [] for key in blocking_s}
    for rep in range(args.reps + 1):
        start = time.perf_counter()
        dcp.save(state, storage_writer=FileSystemWriter(root / "sync", sync_files=True, overwrite=True))
        sync_s.append(time.perf_counter() - start)
        for mode, checkpointer in checkpointers.items():
            for way in WAYS:
                plain_step = train_step(app, tokens_BT, None)[1]
                start = time.perf_counter()
                checkpointer.save(rep + 1, state)
                if way == "staged inside save":
                    checkpointer.wait_for_staging()
                in_save = time.perf_counter() - start
                waited, step = train_step(app, tokens_BT, checkpointer)
                blocking_s[mode, way].append(in_save + waited)
                slowdown_s[mode, way].append(step - waited - plain_step)
                checkpointer.wait()
    for checkpointer in checkpointers.values():
        checkpointer.close()

    sync = statistics.median(sync_s[1:])
    state_gb = sum(f.stat().st_size for f in (root / "sync").iterdir()) / 1e9
    print(f"state: {state_gb:.2f} GB; synchronous DCP save: median {sync:.2f} s ({', '.join(f'{s:.2f}' for s in sync_s[1:])})")
    print("| mode | way | blocking: median (each) | blocking / synchronous | slowdown of the next step: median (each) | "
          "lost: median | lost / synchronous |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, blocking in blocking_s.items():
        # The first save of a mode allocates its buffers (and starts the checkpoint process): left out.
        blocking, slowdown = blocking[1:], slowdown_s[key][1:]
        lost = statistics.median(b + s for b, s in zip(blocking, slowdown))
        print(f"| {key[0]} | {key[1]} | {median_ms(blocking)} ({each_ms(blocking)}) | "
              f"{100 * statistics.median(blocking) / sync:.1f}% | {median_ms(slowdown)} ({each_ms(slowdown)}) | "
              f"{1000 * lost:.0f} ms | {100 * lost / sync:.1f}% |")
    # What `async_mode auto` weighs (ett/checkpoints/writer.py, PROCESS_MIN_BYTES): the first save of each
    # mode, which a job pays once per attempt.
    for mode in modes:
        key = (mode, WAYS[0])
        print(f"first save, {mode}: blocking {1000 * blocking_s[key][0]:.0f} ms, slowdown of the next step "
              f"{1000 * slowdown_s[key][0]:.0f} ms")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
