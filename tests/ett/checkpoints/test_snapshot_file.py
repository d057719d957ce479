"""The local snapshot's file (ett/snapshots/file_format.py) and what a snapshot captures (ett/snapshots/tier.py)."""

import time

import pytest
import torch

from ett.snapshots import file_format as snapshot_file
from ett.snapshots.file_format import StagingBuffer
from ett.snapshots.tier import LocalSnapshots, template


def state() -> dict:
    return {
        "weights": torch.randn(3, 5).to(torch.bfloat16),  # no numpy dtype: written as its bytes
        "mask": torch.tensor([True, False, True]),
        "step": torch.tensor(7),  # 0-dim
        "empty": torch.empty(0, 4),
        "columns": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "nested": [{"lr": 0.1, "betas": (0.9, 0.95)}, torch.ones(1, dtype=torch.float64)],
        "name": "run",
    }


def save(tmp_path, value: dict, staging: StagingBuffer | None = None):
    found: list = []
    header = snapshot_file.header(template(value, found))
    path = tmp_path / "rank-0.snap"
    with open(path, "wb") as file:
        snapshot_file.write(file, header, (staging or StagingBuffer()).copy(found))
    return path


def test_a_snapshot_reads_back_equal_in_dtype_shape_and_values(tmp_path):
    original = state()
    loaded = snapshot_file.read(save(tmp_path, original))
    for key in ("weights", "mask", "step", "empty", "columns"):
        assert loaded[key].dtype == original[key].dtype and torch.equal(loaded[key], original[key]), key
    assert loaded["nested"][0] == {"lr": 0.1, "betas": (0.9, 0.95)}
    assert torch.equal(loaded["nested"][1], original["nested"][1])
    assert loaded["name"] == "run"
    loaded["weights"].add_(1)  # each tensor owns its memory: nothing else changes
    assert torch.equal(loaded["mask"], original["mask"])


def test_a_file_cut_short_corrupt_or_of_another_kind_is_refused(tmp_path):
    path = save(tmp_path, state())
    data = path.read_bytes()
    assert snapshot_file.verify(path) is None
    path.write_bytes(data[:-10])
    assert snapshot_file.verify(path) == "cut short"
    with pytest.raises(ValueError, match="cut short"):
        snapshot_file.read(path)
    flipped = bytearray(data)
    flipped[len(data) - 20] ^= 0x01  # one bit of the tensors' bytes
    path.write_bytes(flipped)
    assert snapshot_file.verify(path) == "its CRC-32 does not match"
    with pytest.raises(ValueError, match="corrupt"):
        snapshot_file.read(path)
    path.write_bytes(b"PK\x03\x04" + data[4:])  # a torch.save zip, say
    with pytest.raises(ValueError, match="not an ETT snapshot"):
        snapshot_file.read(path)


def test_the_staging_buffer_is_kept_while_the_tensors_keep_their_shapes(tmp_path):
    staging, value = StagingBuffer(), state()
    save(tmp_path, value, staging)
    first = staging.buffer
    value["weights"].add_(1)
    save(tmp_path, value, staging)
    assert staging.buffer is first  # the same memory, new contents
    assert torch.equal(snapshot_file.read(tmp_path / "rank-0.snap")["weights"], value["weights"])
    value["weights"] = torch.zeros(4, 5)
    save(tmp_path, value, staging)
    assert staging.buffer is not first


def test_a_snapshot_holds_the_state_as_it_was_when_taken(tmp_path):
    """The loop changes its state as soon as maybe_save returns (the next step's learning rate,
    weights): the write in the background must not see those changes."""
    snapshots = LocalSnapshots(str(tmp_path), rank=0, world_size=1, every=1)
    weights, options = torch.zeros(1000), {"lr": 0.1}
    assert snapshots.maybe_save(1, {"weights": weights, "options": options})
    weights.add_(1)
    options["lr"] = 0.2
    snapshots.close()
    saved = snapshot_file.read(snapshots.folder.path(1, 0))
    assert saved["step"] == 1
    assert torch.equal(saved["state"]["weights"], torch.zeros(1000)) and saved["state"]["options"] == {"lr": 0.1}


def test_a_write_that_waits_without_using_the_cpu_does_not_thin_the_snapshots(tmp_path, monkeypatch):
    """On a busy node a write's wall time is stretched by the steps it competes with; what it
    takes from them is its CPU time, and that is what the cadence weighs (ett/snapshots/tier.py)."""
    real_write = snapshot_file.write

    def slow_write(file, header, buffer):
        time.sleep(0.05)  # 50 ms of waiting: ten times the 5 ms budget of a 100 ms step
        real_write(file, header, buffer)

    monkeypatch.setattr(snapshot_file, "write", slow_write)
    snapshots = LocalSnapshots(str(tmp_path), rank=0, world_size=1)  # adaptive cadence
    for step in range(1, 9):
        time.sleep(0.1)  # a 100 ms step
        snapshots.maybe_save(step, {"weights": torch.zeros(10)})
    snapshots.close()
    assert snapshots.every == 1
    assert snapshots.steps()[:2] == [8, 7]
