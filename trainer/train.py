"""Train the MoE transformer: `torchrun --nproc-per-node N -m trainer.train --preset tiny [...]`.

A user of `ett.Run` like any training script (docs/library.md): the run marks start-up, restores
the newest good checkpoint, times each step, saves at the job's interval and stops after a final
checkpoint on SIGTERM. What is the trainer's own is here and beside it: the model, expert
parallelism and ZeRO, the data, the metrics line. Exit codes (ett.protocol): 0 done, 3
configuration error, 4 stopped by SIGTERM after a final checkpoint; anything else is a failure.
"""

import logging
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import ett
from ett.errors import UsageError
from ett.protocol import EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_OK, EXIT_STOPPED
from ett.state import ModelOptimizerState, RNGState, TrainProgress
from trainer.allocator import keep_freed_memory
from trainer.config import JobConfig, parse_args
from trainer.data import ByteBatchLoader, SourceCorpus
from trainer.log import LogConfig, setup_logging
from trainer.metrics import MetricsLogger
from trainer.model import Transformer
from trainer.parallel import build_mesh, build_optimizer, parallelize

logger = logging.getLogger("trainer.train")


def init_distributed() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # DCP's asynchronous save needs a CPU backend
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:  # plain `python -m trainer.train`: one rank
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient L2 norm over all ranks, and clipping to max_norm (0: no clipping).
    Dense and expert gradients are DTensors on different meshes, which torch's
    clip_grad_norm_ cannot mix: take the norm per mesh, then combine."""
    grads_by_mesh = defaultdict(list)
    for p in model.parameters():
        if p.grad is not None:
            grads_by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    squares = []
    for grads in grads_by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total_norm = torch.stack(squares).sum().sqrt()
    if max_norm > 0:
        for grads in grads_by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total_norm, foreach=False)
    return total_norm


def mean_loss_and_stop(loss: torch.Tensor, stop: bool) -> tuple[float, bool]:
    """One all-reduce per step: the loss averaged over ranks, and whether any rank got SIGTERM
    (all ranks must stop after the same step, or their collectives would no longer pair up)."""
    both = torch.stack([loss.detach().float(), torch.tensor(float(stop), device=loss.device)])
    dist.all_reduce(both)
    return both[0].item() / dist.get_world_size(), both[1].item() > 0


@dataclass
class Training:
    """What start-up builds: the sharded model and its optimizer, the data, the state a
    checkpoint holds, the metrics line."""

    device: torch.device
    model: Transformer
    optimizer: torch.optim.Optimizer
    data: ByteBatchLoader
    progress: TrainProgress
    state: dict[str, Any]
    metrics: MetricsLogger


def build(cfg: JobConfig, full_world_size: int) -> Training:
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    setup_logging(cfg.log, rank)
    # Every rank draws the same full weights, then keeps its shards.
    torch.manual_seed(cfg.train.seed)
    with device:
        model = Transformer(cfg.model, cfg.moe)
    model.init_weights()
    model = parallelize(model, build_mesh(cfg.parallel, world_size, device.type), cfg.parallel)
    betas = (cfg.train.beta1, cfg.train.beta2)
    optimizer = build_optimizer(model, cfg.parallel, cfg.train.lr, cfg.train.weight_decay, betas)
    # The global batch of the full size at any size (docs/trainer.md, "Elastic"): a rank of fewer accumulates.
    data = ByteBatchLoader(SourceCorpus(cfg.data.root), cfg.train.batch_size, cfg.train.seq_len, rank, world_size,
                           cfg.data.seed, full_world_size)  # fmt: skip
    progress = TrainProgress()
    state = {"app": ModelOptimizerState(model, optimizer), "data": data, "rng": RNGState(rank), "progress": progress}
    metrics = MetricsLogger(cfg.log, model, cfg.train.seq_len, world_size, device)
    logger.info("%d ranks on %s; %.2fM parameters (%.2fM active)", world_size, device,
                model.num_params() / 1e6, model.num_params(active_only=True) / 1e6)
    return Training(device, model, optimizer, data, progress, state, metrics)


def train(cfg: JobConfig, run: ett.Run, t: Training) -> int:
    rank, plan = dist.get_rank(), t.data.plan
    if (why := cfg.not_elastic_because()) is None:  # the sizes it keeps the same at; a checkpoint of another size loads
        run.elastic(global_batch=plan.global_batch, micro_batch=plan.micro_batch)
    else:
        logger.info("not elastic (an elastic job runs at full size only): %s", why)
    # Restore: model, optimizer, data position, RNG states and step of the newest good checkpoint.
    t.progress.step = run.restore(t.state)
    tokens_per_step = plan.global_batch * cfg.train.seq_len
    run.total_steps = cfg.train.steps
    stopped = False
    try:
        for step in range(t.progress.step + 1, cfg.train.steps + 1):
            with run.step(step, tokens=tokens_per_step) as s:
                micro_batches = t.data.next_step()
                lr = cfg.train.lr_at(step)
                for group in t.optimizer.param_groups:
                    group["lr"] = lr
                loss = torch.zeros((), device=t.device)
                for inputs_BT, targets_BT in micro_batches:
                    logits_BTV, aux_loss = t.model(inputs_BT.to(t.device))
                    micro_loss = F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.to(t.device).flatten())
                    # FSDP averages over the ranks: scaled by 1/accumulation, the gradient is the
                    # mean over the global batch's micro batches, as at full size.
                    ((micro_loss + aux_loss) / len(micro_batches)).backward()
                    loss += micro_loss.detach() / len(micro_batches)
                # This rank's forward and backward are done: its work is the step so far less its
                # waits in their collectives (FSDP2's all-gathers and reduce-scatters, the experts'
                # all-to-all of token counts), which the library times (ett/waits.py). What follows
                # waits on collectives it does not see (the gradient norm's DTensor all-reduce).
                s.synchronizing()
                grad_norm = clip_grad_norm_(t.model, cfg.train.grad_clip)
                run.wait_for_staging()  # a save's copy of the parameters overlaps forward and backward
                t.optimizer.step()
                t.optimizer.zero_grad(set_to_none=True)
                s.loss, stopped = mean_loss_and_stop(loss, run.sigterm_received)
                t.progress.step = step
            if rank == 0:
                t.metrics.record(step, tokens_per_step, s.loss, lr, grad_norm.item())
            # The stop is agreed in the loss's all-reduce: the run saves this step and raises Stopped.
            run.checkpoint(step, t.state, force=step == cfg.train.steps, stop=stopped, wait_for_staging=False)
            if stopped:
                break  # no checkpoint folder: nothing to save, and the ranks stop all the same
    except ett.Stopped:
        pass
    if stopped:
        logger.warning("SIGTERM: stopped after step %d", t.progress.step)
    run.close()  # the last save is committed, then the end of training is marked
    dist.barrier()
    dist.destroy_process_group()
    return EXIT_STOPPED if stopped else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    setup_logging(LogConfig(), int(os.environ.get("RANK", "0")))
    try:
        # SIGTERM (a stop or a preemption notice) only sets a flag: the step in progress finishes.
        with ett.init(stop_on_sigterm=True) as run:
            with run.initializing():
                cfg = parse_args(sys.argv[1:] if argv is None else argv)
                cfg.validate(run.full_world_size)
                if (ep_changed := cfg.fit_to(run.world_size, run.full_world_size)) is not None:
                    logger.warning("%s", ep_changed)
                run.configure_checkpoints(cfg.checkpoint)
                if not torch.cuda.is_available():  # a CPU run (see init_distributed); CUDA has its caching allocator
                    keep_freed_memory()
                training = build(cfg, run.full_world_size)
            return train(cfg, run, training)
    except ett.Stopped:  # the run, closing after train() agreed on a stop
        return EXIT_STOPPED
    except UsageError as error:  # ConfigError, or a checkpoint this run cannot load
        logger.error("configuration error: %s", error)
        return EXIT_CONFIG_ERROR
    except Exception:
        # Often a peer's death breaking the collectives. Leave at once through os._exit below: an
        # interpreter exit would first wait for the checkpoint threads, stuck in collectives too.
        logger.exception("training failed")
        return EXIT_FAILED


if __name__ == "__main__":
    exit_code = main()
    # Everything is written and closed by now. Skip the interpreter's finalization: torch's C++
    # destructors can deadlock in it (seen: both ranks stuck garbage-collecting after a clean run).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
