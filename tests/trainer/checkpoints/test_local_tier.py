"""The node-local checkpoint tier: saves land in the local folder, are copied to the persistent
one and committed there; a resume reads the local copies that match the manifest, else the
persistent files. On the straight run (conftest.py) and resumes of its step-6 checkpoint."""

import shutil

import pytest

from ett.checkpoints.folders import step_folder, step_folders, verify
from ett.protocol import MARKER
from tests.trainer.trainer_runs import TINY_EP_ZERO3, local_checkpoint_dir, run_trainer

pytestmark = pytest.mark.slow


def test_a_save_lands_locally_and_is_committed_in_the_persistent_folder(straight_run):
    local = local_checkpoint_dir(straight_run.event_dir.parent)
    assert [f.name for f in step_folders(local)] == ["step-00000008", "step-00000006"]  # kept like the persistent ones
    for folder in step_folders(straight_run.checkpoint_dir):
        assert verify(folder) is None
        copy = local / folder.name
        assert MARKER not in {p.name for p in copy.iterdir()}  # only the persistent folder is committed
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            assert (copy / name).read_bytes() == (folder / name).read_bytes()
    committed = [e for e in straight_run.events(0) if e["kind"] == "ckpt_committed"]
    expected = [str(step_folder(straight_run.checkpoint_dir, step)) for step in (2, 4, 6, 8)]
    assert [e["data"]["path"] for e in committed] == expected


def corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


@pytest.mark.parametrize("node, sources", [
    ("unchanged", ["local", "local"]),
    ("new", ["persistent", "persistent"]),  # a node that never ran the job: an empty local folder
    ("corrupt", ["mixed", "persistent"]),  # rank 1's local shards are damaged; rank 0 reads a few items from them
])
def test_a_resume_reads_the_local_copies_that_verify(straight_run, tmp_path, node, sources):
    persistent, local = tmp_path / "ckpt", local_checkpoint_dir(tmp_path)
    shutil.copytree(straight_run.checkpoint_dir, persistent)
    if node != "new":
        shutil.copytree(local_checkpoint_dir(straight_run.event_dir.parent), local)
    if node == "corrupt":
        for shard in (local / "step-00000006").glob("__1_*.distcp"):  # one per write thread
            corrupt(shard)
    # Snapshots off: this is about the persistent checkpoint's local copies (tests/trainer/checkpoints/test_snapshots.py).
    resume = ["--checkpoint.local_dir", str(local), "--checkpoint.resume_from", str(persistent / "step-00000006"),
              "--checkpoint.snapshots", "false"]
    run = run_trainer(tmp_path, [*TINY_EP_ZERO3, "--train.steps", "7", *resume], checkpoint_dir=persistent)
    assert run.returncode == 0, run.stderr

    restored = [next(e for e in run.events(rank) if e["kind"] == "restore_end") for rank in (0, 1)]
    assert [e["step"] for e in restored] == [6, 6]
    assert [e["data"]["source"] for e in restored] == sources
    assert ("__1_0.distcp does not match the manifest" in run.stderr) == (node == "corrupt")
    assert run.losses()[7] == straight_run.losses()[7]  # whichever tier, the same state
