"""A local snapshot's file: one rank's state, its tensors' bytes written as they lie in memory.

    MAGIC | header length (8 bytes, little-endian) | header (pickle) | the tensors' bytes | TRAILER

The trailer holds the CRC-32 of everything before it: a copy torn or corrupted on a disk or on its
way to a peer node (ett/snapshots/peers.py) is refused, never loaded.

The header is the state with each tensor replaced by a `Slot` naming its dtype and shape; the
tensors follow in the order of their slots, each at an offset aligned to `ALIGN` bytes
(`layout`). A snapshot is written every step it can afford (ett/snapshots/tier.py), so its format is
chosen for the CPU it takes: `torch.save` pickles each tensor and writes one zip record per
storage: 6 ms of CPU for a cpu-demo rank's 1.6 MB. Here the copy that takes the snapshot puts
every tensor in one buffer (`StagingBuffer`), written at once: 1 ms (BENCHMARKS.md, "Recovery",
session of 2026-11-26).
"""

import pickle
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

MAGIC = b"ETTSNAP1"
ALIGN = 64  # bytes: every dtype's view of the buffer starts aligned
TRAILER = struct.Struct("<8sI")  # b"ETTCRC32", the CRC-32 of the bytes before it
TRAILER_TAG = b"ETTCRC32"
MIN_BYTES = len(MAGIC) + 8 + TRAILER.size  # an empty header and no tensors
CHUNK_BYTES = 4 << 20


class Slot(NamedTuple):
    """Where a tensor was in the state: the next tensor in the file, of this dtype and shape; for
    a DTensor's shard, its `layout` (ett.state.ShardLayout: the whole tensor's shape, where the shard
    starts), so the snapshot can be resharded at another world size (ett/snapshots/reshard.py)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Any = None


def _nbytes(slot: Slot) -> int:
    return torch.Size(slot.shape).numel() * slot.dtype.itemsize


def layout(slots: list[Slot]) -> tuple[list[int], int]:
    """Each slot's offset in the buffer, and the buffer's size."""
    offsets, end = [], 0
    for slot in slots:
        offsets.append(end)
        end += -(-_nbytes(slot) // ALIGN) * ALIGN
    return offsets, end


def _views(buffer: torch.Tensor, slots: list[Slot]) -> list[torch.Tensor]:
    offsets, _ = layout(slots)
    return [buffer[offset : offset + _nbytes(slot)].view(slot.dtype).view(slot.shape)
            for offset, slot in zip(offsets, slots, strict=True)]  # fmt: skip


class StagingBuffer:
    """One CPU buffer for a snapshot's tensors, and a view of it for each; kept from snapshot to
    snapshot while the tensors keep their dtypes and shapes (every step of a training loop), so
    a copy is one `copy_` per tensor, into page-locked memory where a GPU is."""

    def __init__(self) -> None:
        self.slots: list[Slot] = []
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.views: list[torch.Tensor] = []

    @torch.no_grad()
    def copy(self, found: list[tuple[Slot, torch.Tensor]]) -> torch.Tensor:
        """Copies each tensor of `found` in, at its slot's place; returns the buffer."""
        slots = [slot for slot, _ in found]
        if slots != self.slots:
            _, size = layout(slots)
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self.slots, self.views = slots, _views(self.buffer, slots)
        for view, (_, tensor) in zip(self.views, found, strict=True):
            view.copy_(tensor)
        return self.buffer


def header(template: Any) -> bytes:
    """The state's template (each tensor as its slot), pickled."""
    return pickle.dumps(template, protocol=pickle.HIGHEST_PROTOCOL)


def write(file: BinaryIO, header: bytes, buffer: torch.Tensor) -> None:
    """Writes a snapshot to an open file: its `header`, then the buffer holding the tensors its
    slots name, as `layout` places them, then the trailer."""
    prefix, data = MAGIC + len(header).to_bytes(8, "little") + header, memoryview(buffer.numpy())
    file.write(prefix)
    file.write(data)
    file.write(TRAILER.pack(TRAILER_TAG, zlib.crc32(data, zlib.crc32(prefix))))


def verify(path: Path, feed: Callable[[bytes], object] | None = None) -> str | None:
    """Why the file at `path` is not a whole snapshot (cut short, corrupt), or None when it is:
    its bytes match the trailer's CRC-32. Read in chunks: a rank's snapshot may be gigabytes.
    `feed` gets every byte of the file as read (a peer's copy's seal, ett/snapshots/mac.py, is
    checked in the same pass)."""
    try:
        size = path.stat().st_size
        if size < MIN_BYTES:
            return "cut short"
        crc, left = 0, size - TRAILER.size
        with open(path, "rb") as file:
            while left and (chunk := file.read(min(CHUNK_BYTES, left))):
                crc, left = zlib.crc32(chunk, crc), left - len(chunk)
                if feed is not None:
                    feed(chunk)
            trailer = file.read(TRAILER.size)
            if feed is not None:
                feed(trailer)
            tag, expected = TRAILER.unpack(trailer)
    except OSError as error:
        return f"unreadable ({error.strerror})"
    if tag != TRAILER_TAG:
        return "cut short"
    return None if crc == expected else "its CRC-32 does not match"


def _slots(value: Any, found: list[Slot]) -> list[Slot]:
    if isinstance(value, Slot):
        found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _slots(item, found)
    elif isinstance(value, list) or type(value) is tuple:
        for item in value:
            _slots(item, found)
    return found


def _filled(value: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if isinstance(value, Slot):
        return next(tensors)
    if isinstance(value, dict):
        return {key: _filled(item, tensors) for key, item in value.items()}
    if isinstance(value, list) or type(value) is tuple:
        return type(value)(_filled(item, tensors) for item in value)
    return value


def read_header(path: Path) -> Any:
    """The state's template alone (each tensor as its slot): what a snapshot holds, not read."""
    with open(path, "rb") as file:
        if file.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path}: not an ETT snapshot")
        return pickle.loads(file.read(int.from_bytes(file.read(8), "little")))


def read(path: Path) -> Any:
    """The state `write` wrote, each tensor in memory of its own. A file that is not a whole
    snapshot raises ValueError."""
    with open(path, "rb") as file:
        if file.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path}: not an ETT snapshot")
        header = file.read(int.from_bytes(file.read(8), "little"))
        slots = _slots(pickle.loads(header), [])
        buffer = torch.empty(layout(slots)[1], dtype=torch.uint8)
        whole = file.readinto(memoryview(buffer.numpy())) == buffer.numel()
        trailer = file.read(TRAILER.size)
    if not whole:
        raise ValueError(f"{path}: cut short")
    return _checked(header, buffer, trailer, str(path))


def loads(data: memoryview, name: str) -> Any:
    """`read` of a snapshot's bytes in memory (one sent by the node that holds it); `name` says
    whose it is in an error."""
    if bytes(data[: len(MAGIC)]) != MAGIC or len(data) < MIN_BYTES:
        raise ValueError(f"{name}: not an ETT snapshot")
    start = len(MAGIC) + 8
    header = bytes(data[start : start + int.from_bytes(data[len(MAGIC) : start], "little")])
    end = start + len(header) + layout(_slots(pickle.loads(header), []))[1]
    if end + TRAILER.size != len(data):
        raise ValueError(f"{name}: cut short")
    tensors = bytearray(data[start + len(header) : end])
    buffer = torch.frombuffer(tensors, dtype=torch.uint8) if tensors else torch.empty(0, dtype=torch.uint8)
    return _checked(header, buffer, bytes(data[end:]), name)


def _checked(header: bytes, buffer: torch.Tensor, trailer: bytes, name: str) -> Any:
    """The state of a snapshot read whole, once its trailer's CRC-32 matches."""
    if len(trailer) != TRAILER.size:
        raise ValueError(f"{name}: cut short")
    tag, expected = TRAILER.unpack(trailer)
    prefix = MAGIC + len(header).to_bytes(8, "little") + header
    if tag != TRAILER_TAG or zlib.crc32(memoryview(buffer.numpy()), zlib.crc32(prefix)) != expected:
        raise ValueError(f"{name}: corrupt (its CRC-32 does not match)")
    template = pickle.loads(header)
    return _filled(template, (view.clone() for view in _views(buffer, _slots(template, []))))
