"""The recovery benchmark's baseline trainer: our model, data and parallelism, checkpointed the
plain way. Run under `torchrun --max-restarts R`; it takes the same flags as trainer.train.

Every `checkpoint.interval_steps` steps rank 0 gathers the full state (model, optimizer, data
position, step) to CPU and writes it with a synchronous `torch.save`; every rank waits for that
write. On (re)start every rank loads the newest such file. Events are schema-v1, through our
EventWriter, with the attempt number torchrun gives (TORCHELASTIC_RESTART_COUNT), so the ETT
engine measures this run exactly like an ETT one.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ett.events import EventWriter
from trainer.config import JobConfig, parse_args
from trainer.data import ByteBatchLoader, SourceCorpus
from trainer.model import Transformer
from trainer.parallel import build_mesh, build_optimizer, parallelize
from trainer.train import clip_grad_norm_, mean_loss_and_stop

FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def newest_checkpoint(folder: Path) -> Path | None:
    files = sorted(folder.glob("step-*.pt"))  # zero-padded step numbers sort in order
    return files[-1] if files else None


def save(folder: Path, step: int, model, optimizer, data: ByteBatchLoader, events: EventWriter) -> None:
    events.emit("ckpt_start", step=step)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FULL_ON_CPU)  # a collective
    if dist.get_rank() == 0:
        path = folder / f"step-{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save({"model": model_sd, "optim": optim_sd, "data": data.state_dict(), "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)  # a kill mid-write leaves only a .tmp, never a torn step-*.pt
    dist.barrier()  # synchronous: no rank trains on until the file is written
    events.emit("ckpt_staged", step=step)
    events.emit("ckpt_committed", step=step)


def restore(folder: Path, model, optimizer, data: ByteBatchLoader, events: EventWriter) -> int:
    path = newest_checkpoint(folder)
    if path is None:
        return 0
    events.emit("restore_start")
    state = torch.load(path, map_location="cpu", weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True))
    data.load_state_dict(state["data"])
    events.emit("restore_end", step=state["step"])
    return state["step"]


def attempt() -> int:
    """torchrun's restart count, plus $BENCH_ATTEMPT_OFFSET: a spare node's torchrun (bench/node_loss.py)
    counts from 0 where the survivor it joins is at 1."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + int(os.environ.get("BENCH_ATTEMPT_OFFSET", "0"))


def init_process_group() -> None:
    """torchrun keeps its store across restarts and gloo's keys in it are not per restart, so a
    restarted group reads the dead one's addresses and fails to connect: prefix them."""
    restart = attempt()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The store is torchrun's own (its agent's), unless that is turned off: then rank 0 hosts it.
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=hosts)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"restart-{restart}", store), rank=rank, world_size=world_size)


def train(cfg: JobConfig, events: EventWriter) -> None:
    init_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model, cfg.moe)
    model.init_weights()
    model = parallelize(model, build_mesh(cfg.parallel, world_size, "cpu"), cfg.parallel)
    betas = (cfg.train.beta1, cfg.train.beta2)
    optimizer = build_optimizer(model, cfg.parallel, cfg.train.lr, cfg.train.weight_decay, betas)
    data = ByteBatchLoader(SourceCorpus(cfg.data.root), cfg.train.batch_size, cfg.train.seq_len, rank, world_size, cfg.data.seed)
    folder = Path(cfg.checkpoint.dir)
    folder.mkdir(parents=True, exist_ok=True)
    events.emit("init_end")

    start_step = restore(folder, model, optimizer, data, events)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len * world_size
    for step in range(start_step + 1, cfg.train.steps + 1):
        start = time.perf_counter()
        inputs_BT, targets_BT = data.next_batch()
        for group in optimizer.param_groups:
            group["lr"] = cfg.train.lr_at(step)
        logits_BTV, aux_loss = model(inputs_BT)
        loss = F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())
        (loss + aux_loss).backward()
        clip_grad_norm_(model, cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss, _ = mean_loss_and_stop(loss, False)
        events.progress(step)
        if rank == 0:
            events.emit("step", step=step, duration=time.perf_counter() - start, tokens=tokens_per_step, loss=mean_loss)
        if step % cfg.checkpoint.interval_steps == 0 or step == cfg.train.steps:
            save(folder, step, model, optimizer, data, events)
    events.emit("train_end", step=cfg.train.steps)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    rank = int(os.environ["RANK"])
    events = EventWriter(os.environ["ETT_EVENT_DIR"], rank, attempt())
    events.emit("init_start", pid=os.getpid())
    try:
        cfg = parse_args(sys.argv[1:])
        cfg.validate(int(os.environ["WORLD_SIZE"]))
        if not cfg.checkpoint.dir or cfg.checkpoint.interval_steps < 1:
            raise SystemExit("--checkpoint.dir and --checkpoint.interval_steps >= 1 are required")
        train(cfg, events)
    finally:
        events.close()


if __name__ == "__main__":
    main()
    os._exit(0)  # as trainer.train: skip torch's finalisation, which can deadlock
