"""Commit markers, retention and the choice of the checkpoint to resume from, on the real
checkpoints of the straight run (conftest.py); corruptions are made on copies."""

import json
import logging
import shutil

import pytest

from ett.checkpoint import CheckpointConfig, find_resume_folder
from ett.checkpoints.folders import step_folders, verify
from ett.protocol import MARKER


@pytest.fixture
def checkpoints(straight_run, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(straight_run.checkpoint_dir, copy)
    return copy


def test_only_the_newest_committed_checkpoints_are_kept(straight_run):
    folders = step_folders(straight_run.checkpoint_dir)
    assert [f.name for f in folders] == ["step-00000008", "step-00000006"]  # keep 2 of 2, 4, 6, 8
    assert all(verify(f) is None for f in folders)


def test_the_marker_is_a_manifest_of_every_file_of_the_checkpoint(straight_run):
    folder = step_folders(straight_run.checkpoint_dir)[0]
    manifest = json.loads((folder / MARKER).read_text())
    assert manifest["step"] == 8 and manifest["world_size"] == 2
    # Each rank lists its own files (one per write thread); rank 0 adds DCP's metadata.
    assert set(manifest["files"]) == {p.name for p in folder.iterdir() if p.name != MARKER}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"])
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (folder / name).stat().st_size > 0


def test_auto_resume_picks_the_newest_committed_checkpoint(checkpoints):
    assert find_resume_folder(CheckpointConfig(dir=str(checkpoints))) == checkpoints / "step-00000008"


def test_a_corrupt_file_in_the_newest_checkpoint_makes_resume_fall_back_with_a_warning(checkpoints, caplog):
    shard = checkpoints / "step-00000008" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="ett.checkpoint"):
        assert find_resume_folder(CheckpointConfig(dir=str(checkpoints))) == checkpoints / "step-00000006"
    assert "step-00000008: __1_0.distcp fails its CRC-32 check" in caplog.text


@pytest.mark.parametrize("damage, reason", [
    (lambda folder: (folder / ".metadata").unlink(), "missing file .metadata"),
    (lambda folder: (folder / "__0_0.distcp").write_bytes(b"short"), "__0_0.distcp has 5 bytes"),
    (lambda folder: (folder / MARKER).unlink(), f"no {MARKER} marker"),
    (lambda folder: (folder / MARKER).write_text("{"), f"unreadable {MARKER} marker"),
])
def test_a_damaged_checkpoint_is_never_chosen(checkpoints, caplog, damage, reason):
    damage(checkpoints / "step-00000008")
    assert reason in verify(checkpoints / "step-00000008")
    assert find_resume_folder(CheckpointConfig(dir=str(checkpoints))) == checkpoints / "step-00000006"


def test_an_explicit_folder_is_used_and_falls_back_to_older_ones_beside_it(checkpoints):
    newest, older = checkpoints / "step-00000008", checkpoints / "step-00000006"
    assert find_resume_folder(CheckpointConfig(resume_from=str(older))) == older
    (newest / MARKER).unlink()
    assert find_resume_folder(CheckpointConfig(resume_from=str(newest))) == older
    assert find_resume_folder(CheckpointConfig(resume_from=str(checkpoints / "step-00000099"))) == older


def test_nothing_is_resumed_with_none_or_when_no_checkpoint_verifies(checkpoints, caplog):
    assert find_resume_folder(CheckpointConfig(dir=str(checkpoints), resume_from="none")) is None
    for folder in step_folders(checkpoints):
        (folder / MARKER).unlink()
    with caplog.at_level(logging.WARNING, logger="ett.checkpoint"):
        assert find_resume_folder(CheckpointConfig(dir=str(checkpoints))) is None
    assert "no checkpoint verifies" in caplog.text


@pytest.mark.parametrize("field, value", [("keep", 0), ("interval_steps", -1), ("async_mode", "fork"), ("resume_from", "/tmp/x"),
                                          ("local_dir", "/tmp/x")])  # a local tier needs a persistent dir
def test_bad_checkpoint_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"checkpoint.{field}"):
        CheckpointConfig(**{field: value}).validate()
