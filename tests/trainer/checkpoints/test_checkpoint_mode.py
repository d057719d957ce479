"""`async_mode auto`: a checkpoint process only for a large state, and every rank agrees."""

import torch
import torch.distributed as dist

import ett.checkpoints.writer
from ett.checkpoint import CheckpointConfig, Checkpointer
from ett.checkpoints.writer import agree_on_mode
from ett.events import EventWriter
from ett.checkpoints.folders import step_folder
from ett.protocol import MARKER
from tests.trainer.multiprocess import run_on_ranks


def modes_chosen(root: str, min_bytes: int, sizes: list[int]) -> list[str]:
    """The mode each config picks on this rank, whose state holds sizes[rank] bytes."""
    ett.checkpoints.writer.PROCESS_MIN_BYTES = min_bytes
    state = {"weights": torch.zeros(sizes[dist.get_rank()], dtype=torch.uint8)}
    events = EventWriter(None, dist.get_rank(), 0)
    chosen = []
    for config in (CheckpointConfig(), CheckpointConfig(async_mode="process"), CheckpointConfig(async_mode="thread")):
        config.dir = f"{root}/ckpt"  # the first: the default, auto
        checkpointer = Checkpointer(config, events)
        chosen.append(agree_on_mode(config.async_mode, state, checkpointer.group).value)
        checkpointer.close()
    return chosen


def test_auto_saves_from_a_thread_unless_every_rank_holds_a_large_state(tmp_path):
    small = run_on_ranks(modes_chosen, 2, str(tmp_path), 1 << 20, [1000, 1000], timeout=60)
    assert small == ["thread", "process", "thread"]
    large = run_on_ranks(modes_chosen, 2, str(tmp_path), 1 << 20, [2 << 20, 2 << 20], timeout=60)
    assert large == ["process", "process", "thread"]
    # Ranks of different sizes (expert parallelism) still agree: the checkpoint processes form one group.
    mixed = run_on_ranks(modes_chosen, 2, str(tmp_path), 1 << 20, [2 << 20, 1000], timeout=60)
    assert mixed == ["thread", "process", "thread"]


def save_with_each_mode_in_turn(root: str) -> list[bool]:
    """Checkpointers one after another in one process (a bench, a notebook): each closes its own
    checkpoint process only, and a later process-based one starts a new process."""
    events = EventWriter(None, 0, 0)
    committed = []
    for step, async_mode in enumerate(("process", "thread", "process"), start=1):
        checkpointer = Checkpointer(CheckpointConfig(dir=f"{root}/ckpt", async_mode=async_mode), events)
        checkpointer.save(step, {"weights": torch.full((8,), float(step))})
        checkpointer.close()
        committed.append((step_folder(f"{root}/ckpt", step) / MARKER).exists())
    return committed


def test_checkpointers_of_either_mode_follow_one_another_in_a_process(tmp_path):
    assert run_on_ranks(save_with_each_mode_in_turn, 1, str(tmp_path), timeout=120) == [True, True, True]
