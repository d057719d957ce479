"""The node-local fast tier of checkpoints (`checkpoint.local_dir`).

With a local folder, DCP writes each save there (node-local disk, no fsync: it is a cache), then
each rank copies its own shard files `__<rank>_<i>.distcp` to the persistent folder with fsync,
computing their CRC-32s on the way (without a local folder, each rank reads back its own files for
them); once every rank's copy is durable, rank 0 copies DCP's `.metadata` and writes the marker.
The persistent folder alone is the checkpoint of record: the service catalogs it and resume picks
it.

Resume reads each file of the chosen persistent checkpoint from this node's local folder when
the local copy has the manifest's size and CRC-32, else from the persistent folder. Checking each
file against the manifest, rather than trusting "same node", keeps every case right: a node that
ran the same ranks before reads its own shards locally; a new node, or one given other ranks,
finds nothing that matches and reads the persistent copy; a corrupt local file is skipped. A
rank may also read items another rank wrote (DCP saves a replicated tensor once), so one rank
can read from both tiers.
"""

import logging
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem

from ett.checkpoints.rank_values import differing

logger = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def file_crc32(path: Path) -> int:
    crc = 0
    for chunk in _chunks(path):
        crc = zlib.crc32(chunk, crc)
    return crc


def file_entry(path: Path) -> dict[str, int]:
    """A file's manifest entry (bytes, CRC-32), read from the file."""
    return {"bytes": path.stat().st_size, "crc32": file_crc32(path)}


def copy_durably(source: Path, target: Path) -> dict[str, int]:
    """Copy one file and fsync it; returns its manifest entry (bytes, CRC-32 of what was read)."""
    crc, size = 0, 0
    with open(target, "wb") as out:
        for chunk in _chunks(source):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return {"bytes": size, "crc32": crc}


def own_shard_files(folder: Path, rank: int) -> list[Path]:
    """The files this rank wrote: DCP's FileSystemWriter names them `__<rank>_<i>.distcp`."""
    return sorted(folder.glob(f"__{rank}_*.distcp"))


def gather_manifest(upload: Future, written: Path, folder: Path, group: dist.ProcessGroup,
                    digests: dict[str, int]) -> tuple[dict[str, dict], list[str]] | None:
    """Run by every rank once DCP's save to `written` is done. Each rank takes care of its own
    shard files: copied to `folder` durably when `written` is the local tier, else read back for
    their CRC-32s in place (DCP fsynced them; they are still in the page cache). So each rank reads
    only what it wrote, all ranks at once: rank 0 alone reading every rank's files would take as
    long as the whole checkpoint's size over one reader. One all-gather (reached even by a rank
    whose part failed, so none waits for ever) tells all that every part is done; then rank 0
    adds DCP's metadata, copied last as DCP writes it. The same gather carries each rank's
    `digests` of the entries DCP keeps one copy of (ett/checkpoints/rank_values.py). Returns, on rank 0, the
    manifest's entries and the keys whose values differed between ranks; None on the others;
    raises on every rank when any rank's part failed."""
    def record(path: Path) -> dict[str, int]:
        return file_entry(path) if written == folder else copy_durably(path, folder / path.name)

    rank = dist.get_rank()
    entries, error = {}, None
    try:
        upload.result()
        folder.mkdir(parents=True, exist_ok=True)
        for path in own_shard_files(written, rank):
            entries[path.name] = record(path)
    except Exception as exc:
        error = f"rank {rank}: {exc!r}"
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (entries, error, digests), group=group)
    errors = [error for _, error, _ in gathered if error]
    if errors:
        raise RuntimeError(f"checkpoint {folder}: saving failed: {'; '.join(errors)}")
    if rank != 0:
        return None
    files = {name: entry for rank_entries, _, _ in gathered for name, entry in rank_entries.items()}
    files[".metadata"] = record(written / ".metadata")
    return files, differing([rank_digests for _, _, rank_digests in gathered])


class TieredFileSystem(FileSystem):
    """Resolves each file of a checkpoint to the local copy when it matches the manifest.

    DCP's reader joins every path it opens (`.metadata` and the shard files) through
    `concat_path`, so this is the one place where a tier is chosen; each file is checked once.
    """

    def __init__(self, persistent: Path, local: Path | None, manifest_files: dict[str, dict[str, int]]):
        super().__init__()
        self.persistent, self.local, self.expected = persistent, local, manifest_files
        self._tiers: dict[str, Path] = {}

    def concat_path(self, path: str | os.PathLike, suffix: str) -> Path:
        if Path(path) != self.persistent:
            return Path(path) / suffix
        return self.resolve(suffix) / suffix

    def resolve(self, name: str) -> Path:
        if name not in self._tiers:
            self._tiers[name] = self.local if self._local_copy_matches(name) else self.persistent
        return self._tiers[name]

    def _local_copy_matches(self, name: str) -> bool:
        if self.local is None or name not in self.expected:
            return False
        path, expected = self.local / name, self.expected[name]
        if not path.is_file():
            return False
        if path.stat().st_size == expected["bytes"] and file_crc32(path) == expected["crc32"]:
            return True
        logger.warning("local checkpoint file %s does not match the manifest; reading %s instead",
                       path, self.persistent / name)
        return False


class TieredReader(FileSystemReader):
    """DCP's file reader over the two tiers; counts the bytes each rank read from each."""

    def __init__(self, persistent: Path, local: Path | None, manifest_files: dict[str, dict[str, int]]):
        super().__init__(persistent)
        self.fs = TieredFileSystem(Path(self.path), local, manifest_files)
        self.bytes_read = {"local": 0, "persistent": 0}

    def read_data(self, plan, planner):
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            tier = "local" if self.fs.resolve(info.relative_path) == self.fs.local else "persistent"
            self.bytes_read[tier] += info.length
        return super().read_data(plan, planner)

    @property
    def source(self) -> str:
        """Where this rank's state came from: "local", "persistent" or "mixed"."""
        local, persistent = self.bytes_read["local"], self.bytes_read["persistent"]
        if local and persistent:
            return "mixed"
        return "local" if local else "persistent"
