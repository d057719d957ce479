"""ett.integrations.accelerate in one process on real Accelerate: saves at the interval into
committed folders pruned to `keep`, resume from the newest that verifies (a torn and a corrupt
newer one skipped, saying why), inert without a folder. The 2-node job, its kill and its cancel:
tests/e2e/test_own_scripts.py."""

import logging

import pytest
import torch
from accelerate import Accelerator
from torch import nn

import ett
from ett.checkpoints.folders import verify
from ett.integrations.accelerate import checkpoint_folder, resume, save
from ett.protocol import MARKER


@pytest.fixture(autouse=True)
def no_ett_environment(monkeypatch):
    for name in ("ETT_JOB_ID", "ETT_EVENT_DIR", "ETT_CHECKPOINT_DIR", "ETT_RESUME_FROM", "ETT_CHECKPOINT_INTERVAL_STEPS",
                 "ETT_CHECKPOINT_KEEP", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def prepared(seed: int) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train(run: ett.Run, steps: range) -> dict[int, dict[str, torch.Tensor]]:
    """Trains and saves each step; the parameters after each step."""
    accelerator, model, optimizer = prepared(0)
    after = {}
    for step in steps:
        with run.step(step):
            loss = model(torch.full((2, 4), float(step))).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        after[step] = {k: v.clone() for k, v in model.state_dict().items()}
        save(run, accelerator, step)
    return after


def test_saves_at_the_interval_keeps_the_newest_and_resumes_from_the_newest_that_verifies(tmp_path, caplog):
    with ett.init(checkpoint_dir=tmp_path, interval_steps=5, keep=2) as run:
        after = train(run, range(1, 16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accelerate-00000010", "accelerate-00000015"]
    assert all(verify(p) is None for p in tmp_path.iterdir())
    newest = checkpoint_folder(tmp_path, 15) / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-4] + b"\0\0\0\0")  # corrupt: same size, other bytes
    torn = checkpoint_folder(tmp_path, 20)  # killed while Accelerate wrote it
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"partial")

    with caplog.at_level(logging.WARNING), ett.init(checkpoint_dir=tmp_path, interval_steps=5, keep=2) as run:
        accelerator, model, _ = prepared(1)  # other weights: the checkpoint's must come back
        assert resume(run, accelerator) == 10
    assert all(torch.equal(model.state_dict()[k], after[10][k]) for k in after[10])
    assert f"skipping checkpoint {torn}: no {MARKER} marker" in caplog.text
    assert f"skipping checkpoint {newest.parent}: model.safetensors fails its CRC-32 check" in caplog.text


def test_without_a_folder_resume_finds_nothing_and_save_saves_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with ett.init(interval_steps=1) as run:
        accelerator, model, _ = prepared(0)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert resume(run, accelerator) == 0
        assert save(run, accelerator, 1, force=True) is False
    assert list(tmp_path.iterdir()) == [] and all(torch.equal(model.state_dict()[k], before[k]) for k in before)


def test_accelerates_own_folder_naming_is_refused_naming_the_setting(tmp_path):
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True))
    with ett.init(checkpoint_dir=tmp_path / "ckpt") as run, pytest.raises(ett.UsageError,
                                                                          match="automatic_checkpoint_naming=True"):
        save(run, accelerator, 5, force=True)
    assert not (tmp_path / "proj").exists()
