"""The byte-level corpus and the per-rank, resumable batch loader."""

import hashlib
import os
import sysconfig

import pytest
import torch

from trainer.data import ByteBatchLoader, DataConfig, SourceCorpus


@pytest.fixture(scope="module")
def stdlib() -> SourceCorpus:
    return SourceCorpus()


@pytest.fixture
def small_corpus(tmp_path) -> SourceCorpus:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.py").write_bytes(bytes(range(0, 100)))
    (tmp_path / "b" / "c.py").write_bytes(bytes(range(100, 250)))
    (tmp_path / "notes.txt").write_bytes(b"not python")
    return SourceCorpus(str(tmp_path))


def test_the_default_corpus_is_the_standard_library_without_installed_packages(stdlib):
    assert str(stdlib.root) == sysconfig.get_paths()["stdlib"]
    assert any(os.path.basename(p) == "os.py" for p in stdlib.paths)
    assert not any("site-packages" in p.split(os.sep) for p in stdlib.paths)
    assert stdlib.num_bytes > 1_000_000


def test_the_corpus_is_the_sorted_files_as_one_stream(small_corpus):
    assert [os.path.basename(p) for p in small_corpus.paths] == ["a.py", "c.py"]
    assert small_corpus.read(95, 10) == bytes(range(95, 105))  # across the file boundary
    assert small_corpus.read(0, 250) == bytes(range(250))


def test_the_fingerprint_is_the_listing_of_relative_names_and_sizes(small_corpus):
    # Checkpoints store it (ByteBatchLoader.state_dict): its recipe must not change between versions.
    assert small_corpus.fingerprint == hashlib.sha256(b"a.py:100\nb/c.py:150").hexdigest()[:16]


def test_targets_are_the_inputs_shifted_by_one_byte(stdlib):
    inputs_BT, targets_BT = ByteBatchLoader(stdlib, 4, 64, rank=0, world_size=1, seed=0).next_batch()
    assert inputs_BT.shape == targets_BT.shape == (4, 64) and inputs_BT.dtype == torch.long
    assert torch.equal(inputs_BT[:, 1:], targets_BT[:, :-1])


def test_batches_are_deterministic_and_ranks_get_different_data(stdlib):
    def first_batches(rank: int) -> list[torch.Tensor]:
        loader = ByteBatchLoader(stdlib, 4, 64, rank=rank, world_size=2, seed=0)
        return [loader.next_batch()[0] for _ in range(3)]

    rank0, rank1 = first_batches(0), first_batches(1)
    assert all(torch.equal(a, b) for a, b in zip(rank0, first_batches(0)))
    assert not any(torch.equal(a, b) for a, b in zip(rank0, rank1))


def test_a_loader_restored_from_its_state_serves_the_same_next_batches(stdlib):
    loader = ByteBatchLoader(stdlib, 2, 32, rank=1, world_size=2, seed=3)
    for _ in range(5):
        loader.next_batch()
    restored = ByteBatchLoader(stdlib, 2, 32, rank=1, world_size=2, seed=3)
    restored.load_state_dict(loader.state_dict())
    for _ in range(3):
        assert torch.equal(loader.next_batch()[0], restored.next_batch()[0])


def test_a_loader_restored_in_a_later_epoch_serves_that_epochs_order(small_corpus):
    loader = ByteBatchLoader(small_corpus, 2, 32, rank=0, world_size=2, seed=3)
    while loader.epoch < 2:
        loader.next_batch()
    restored = ByteBatchLoader(small_corpus, 2, 32, rank=0, world_size=2, seed=3)
    restored.load_state_dict(loader.state_dict())
    assert (restored.epoch, restored.batch) == (2, loader.batch)
    for _ in range(3):
        assert torch.equal(loader.next_batch()[0], restored.next_batch()[0])


def test_each_epoch_splits_every_window_between_the_ranks_in_a_new_order(small_corpus):
    def windows_per_epoch(rank: int) -> list[set[int]]:
        loader = ByteBatchLoader(small_corpus, batch_size=2, seq_len=10, rank=rank, world_size=2, seed=0)
        assert loader.num_windows == 24 and loader.batches_per_epoch == 6
        # window w starts at byte w * 10 of the stream, whose byte values are their offsets
        return [{b // 10 for _ in range(6) for b in loader.next_batch()[0][:, 0].tolist()} for _ in range(2)]

    (rank0_epoch0, rank0_epoch1), (rank1_epoch0, _) = windows_per_epoch(0), windows_per_epoch(1)
    assert rank0_epoch0 | rank1_epoch0 == set(range(24)) and not rank0_epoch0 & rank1_epoch0
    assert rank0_epoch0 != rank0_epoch1


def test_a_folder_without_python_files_or_missing_is_refused(tmp_path):
    with pytest.raises(ValueError, match="data.root"):
        SourceCorpus(str(tmp_path))
    with pytest.raises(ValueError, match="data.root"):
        DataConfig(root=str(tmp_path / "missing")).validate()


def test_at_fewer_ranks_a_step_takes_the_full_sizes_batches_and_its_position_resumes_at_any_size(stdlib):
    full = [ByteBatchLoader(stdlib, 2, 32, rank=r, world_size=2, seed=3) for r in range(2)]
    shrunk = ByteBatchLoader(stdlib, 2, 32, rank=0, world_size=1, seed=3, full_world_size=2)
    for _ in range(3):
        micro_batches = shrunk.next_step()
        assert len(micro_batches) == 2
        assert all(torch.equal(mine[0], theirs.next_batch()[0]) for mine, theirs in zip(micro_batches, full))
    grown = ByteBatchLoader(stdlib, 2, 32, rank=1, world_size=2, seed=3)
    grown.load_state_dict(shrunk.state_dict())
    assert torch.equal(grown.next_batch()[0], shrunk.next_step()[1][0])


def test_an_epochs_order_is_the_int64_permutation_checkpoints_of_earlier_versions_were_trained_on(stdlib):
    # The order is drawn in int32 for speed; a checkpoint written when it was drawn in int64
    # (torch's default) must resume on the same windows.
    loader = ByteBatchLoader(stdlib, batch_size=2, seq_len=128, rank=0, world_size=2, seed=3)
    loader.epoch = 1
    expected = torch.randperm(loader.num_windows, generator=torch.Generator().manual_seed(3 * 1_000_003 + 1))
    assert torch.equal(loader._epoch_order().long(), expected)
