"""The save's copy of parameters and optimizer state overlaps the next forward and backward:
what it writes must still be the state as it was at `save`.

The copy thread is held (as a slow copy would be) until the test lets it go, so the forward,
backward and optimizer step below really run while the copy is in flight."""

import json
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ett.checkpoint import CheckpointConfig, Checkpointer
from ett.events import EventWriter
from ett.checkpoints.folders import step_folder
from ett.protocol import EVENTS_DIR, MARKER, rank_spool
from ett.state import ModelOptimizerState, TrainProgress
from tests.trainer.multiprocess import run_on_ranks
from trainer.model import ModelConfig, Transformer
from trainer.moe import MoEConfig
from trainer.parallel import ParallelConfig, build_mesh, build_optimizer, parallelize

MODEL = ModelConfig(dim=64, n_layers=2, n_heads=2, max_seq_len=16)
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=64, aux_free_bias=True, bias_update_rate=0.1)


def local_tensors(value, path=()) -> dict[tuple, torch.Tensor]:
    """Every tensor of a state dict (DTensors: this rank's shard), cloned, by key path."""
    if isinstance(value, torch.Tensor):
        return {path: (value.to_local() if isinstance(value, DTensor) else value).clone()}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in local_tensors(item, (*path, key)).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in local_tensors(item, (*path, i)).items()}
    return {}


def train_step(model: nn.Module, tokens_BT: torch.Tensor) -> None:
    logits_BTV, aux_loss = model(tokens_BT[:, :-1])
    (F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten()) + aux_loss).backward()


def hold_copy_thread(checkpointer: Checkpointer) -> threading.Event:
    release = threading.Event()
    checkpointer.stager.copier.submit(release.wait)
    return release


def save_then_train_on(root: str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Transformer(MODEL, MOE)
    model.init_weights()
    parallel = ParallelConfig(ep=2, zero=3, mixed_precision="none")
    model = parallelize(model, build_mesh(parallel, dist.get_world_size(), "cpu"), parallel)
    optimizer = build_optimizer(model, parallel, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    tokens_BT = torch.randint(0, MODEL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    train_step(model, tokens_BT)
    optimizer.step()  # Adam moments exist: they are saved too
    optimizer.zero_grad()
    app, progress = ModelOptimizerState(model, optimizer), TrainProgress()
    state = {"app": app, "progress": progress}
    progress.step = 1
    at_save = local_tensors(app.state_dict())

    events = EventWriter(f"{root}/events", rank, 0)
    checkpointer = Checkpointer(CheckpointConfig(dir=f"{root}/ckpt", async_mode="thread"), events)
    release = hold_copy_thread(checkpointer)
    checkpointer.save(1, state)
    progress.step = 2  # the loop's own state moves on at once: copied by save, not later
    train_step(model, tokens_BT)  # the forward moves the router's expert_bias (aux_free_bias)
    # A correct wait blocks until the copy thread is let go and done; were it to return at once,
    # the optimizer step would change every parameter and moment before they are copied.
    threading.Timer(0.3, release.set).start()
    checkpointer.wait_for_staging()
    optimizer.step()
    after_step = local_tensors(app.state_dict())
    checkpointer.wait()

    unchanged = sorted(str(path) for path in at_save if torch.equal(at_save[path], after_step[path]))
    restored_step, _ = checkpointer.restore(state)
    restored = local_tensors(app.state_dict())
    checkpointer.close()
    events.close()
    differ = sorted(str(path) for path in at_save if not torch.equal(at_save[path], restored[path]))
    paths = [str(path) for path in at_save]
    return {"paths": paths, "unchanged": unchanged, "differ": differ, "restored_step": restored_step}


def test_the_checkpoint_holds_the_state_at_save_while_forward_backward_and_step_overlap_its_copy(tmp_path):
    result = run_on_ranks(save_then_train_on, 2, str(tmp_path), timeout=60)
    # Every saved tensor moved after save (expert_bias in the forward, the rest in the step),
    # so a copy that read any of them late would differ from the state at save.
    assert any("expert_bias" in path for path in result["paths"]) and result["unchanged"] == []
    assert result["restored_step"] == 1 and result["differ"] == []
    assert (step_folder(tmp_path / "ckpt", 1) / MARKER).exists()


def save_a_state_whose_copy_fails(root: str) -> tuple[list[str], bool]:
    model = nn.Linear(4, 4, device="meta")  # no data: its copy raises in the copy thread
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    events = EventWriter(f"{root}/{EVENTS_DIR}", 0, 0)
    checkpointer = Checkpointer(CheckpointConfig(dir=f"{root}/ckpt", async_mode="thread"), events)
    checkpointer.save(1, {"app": ModelOptimizerState(model, optimizer), "progress": TrainProgress()})
    checkpointer.wait_for_staging()  # the loop goes on: the failure is reported by an event
    checkpointer.close()
    events.close()
    kinds = [json.loads(line)["kind"] for line in open(f"{root}/{EVENTS_DIR}/{rank_spool(0)}")]
    return kinds, (step_folder(f"{root}/ckpt", 1) / MARKER).exists()


def test_a_copy_that_fails_in_the_background_is_a_failed_checkpoint_never_a_committed_one(tmp_path):
    kinds, committed = run_on_ranks(save_a_state_whose_copy_fails, 1, str(tmp_path), timeout=60)
    assert kinds == ["ckpt_start", "ckpt_staged", "ckpt_failed"]
    assert not committed
