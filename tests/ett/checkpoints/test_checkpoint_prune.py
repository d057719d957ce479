"""Deleting old checkpoints after a commit, which runs beside the next save (ett/checkpoint.py)."""

import pytest
import torch.distributed as dist

from ett.checkpoint import CheckpointConfig, Checkpointer
from ett.events import EventWriter
from ett.checkpoints.folders import step_folder, step_folders, write_marker


@pytest.fixture
def single_rank_group():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def test_pruning_after_a_commit_spares_the_next_save_in_progress(tmp_path, single_rank_group, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # this rank looks after the node's local folder
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"), keep=1)
    for step in (2, 4, 6):  # 2 and 4 committed; 6 is being written when 4's commit prunes
        for root in (cfg.dir, cfg.local_dir):
            step_folder(root, step).mkdir(parents=True)
        if step < 6:
            write_marker(step_folder(cfg.dir, step), step, 1, {})
    checkpointer = Checkpointer(cfg, EventWriter(None, 0, 0))
    checkpointer._prune(4)
    checkpointer.close()
    assert [f.name for f in step_folders(cfg.dir)] == ["step-00000006", "step-00000004"]
    assert [f.name for f in step_folders(cfg.local_dir)] == ["step-00000006", "step-00000004"]
