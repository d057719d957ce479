"""An elastic run's restart at another world size from the fast tier: snapshots taken at W ranks,
loaded at W' ranks, resharded (ett/elastic.py: the service shrinks such a job when it loses a node).

A snapshot holds one rank's own shard of each tensor and, for a DTensor's, where that shard lies in
the whole tensor (its `Slot`'s or its ShardLayout's `offsets`, ett/state.py). Once every old rank's
snapshot of one step is offered by some node (its own, or a peer's copy: ett/snapshots/peers.py),
each new rank builds its own state from them: for each tensor of its state, the old shards that
overlap its own shard are copied into place, from its node's copies, or sent whole by the node
that holds them. Where several old ranks hold the same shard (a replicated tensor: DDP's
parameters), one copy is taken, its node's own first. Plain values (a number, a learning rate)
come from old rank 0's snapshot, as the persistent tier takes them (ett/checkpoints/rank_values.py);
one rank 0 did not hold, from the lowest old rank that did. An optimizer not stepped yet is given
its state first, as DCP's `get_state_dict` does, so its moments have a place. The choice of step
and holders, and the check of each copy before it is read (its CRC-32, a peer's copy's seal), are
the same-size restore's (ett/snapshots/restore.py).

Anything that does not fit (a shape that differs, a shard no old rank holds, a snapshot written
before shards kept their offsets) raises `Unfit` on that rank; the ranks agree, and all of them
then resume from the persistent tier instead (ett/checkpoint.py).
"""

import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ett.checkpoints.state_load import LoadReport, load_saved
from ett.snapshots import file_format as snapshot_file
from ett.snapshots import mac as snapshot_mac
from ett.snapshots import restore as snapshot_restore
from ett.snapshots.file_format import Slot
from ett.snapshots.folder import SnapshotFolder, snapshots_root

Path_ = tuple  # keys and indices from the state's top, to one entry
MISSING = object()


class Unfit(Exception):
    """The snapshots of another size cannot make this rank's state: why, in one line."""


@dataclass(frozen=True)
class Chunk:
    """Where a shard lies: the whole tensor's shape, the shard's first index and its shape."""

    whole: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Found:
    """Snapshots of another world size of which every rank's copy of `step` is offered."""

    world_size: int
    step: int
    sources: dict[int, int]  # old rank -> the rank of this run that holds its copy
    offers: list  # each rank's offer (ett/snapshots/restore.py)


def chunk_of(leaf: Any) -> Chunk | None:
    """A template's tensor (a Slot, or ModelOptimizerState's {"shard", "layout"}) as a chunk; None
    for anything else."""
    if isinstance(leaf, dict) and leaf.keys() == {"shard", "layout"} and isinstance(leaf["shard"], Slot):
        slot, layout = leaf["shard"], leaf["layout"]
    elif isinstance(leaf, Slot):
        slot, layout = leaf, leaf.layout
    else:
        return None
    if layout is None:  # a plain tensor: whole
        return Chunk(slot.shape, (0,) * len(slot.shape), slot.shape)
    if getattr(layout, "offsets", None) is None:
        raise Unfit("the snapshot was written before shards kept their offsets")
    return Chunk(tuple(layout.shape), tuple(layout.offsets), slot.shape)


def other_sizes(local_dir: str, world_size: int) -> list[int]:
    """The world sizes other than this run's that this node holds snapshots of."""
    sizes = [folder.name.removeprefix("w") for folder in (Path(local_dir) / "snapshots").glob("w*")]
    return sorted(int(size) for size in sizes if size.isdigit() and int(size) != world_size)


def find(local_dir: str, world_size: int, rank: int, group: dist.ProcessGroup | None) -> Found | None:
    """A collective: the newest step of another world size of which every old rank's snapshot is
    offered by some node, its copies checked; None when there is none."""
    folders = {size: SnapshotFolder(snapshots_root(local_dir, size)) for size in other_sizes(local_dir, world_size)}
    offers: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(offers, {size: snapshot_restore.offer(folder, range(size))
                                    for size, folder in folders.items()}, group=group)  # fmt: skip
    newest = []  # (step, world size), before the copies are checked
    for size in {size for offer in offers for size in offer}:
        step, _ = snapshot_restore.choose([offer.get(size, {}) for offer in offers], size)
        if step is not None:
            newest.append((step, size))
    if not newest:
        return None
    size = max(newest)[1]
    folder = SnapshotFolder(snapshots_root(local_dir, size))
    step, sources, checked = snapshot_restore.agree(folder, rank, range(size), group, saved_world_size=size)
    return Found(size, step, sources, checked) if step is not None else None


def _at(value: Any, path: Path_) -> Any:
    for key in path:
        if isinstance(value, dict):
            value = value.get(key, MISSING)
        elif _sequence(value) and isinstance(key, int) and key < len(value):
            value = value[key]
        else:
            return MISSING
        if value is MISSING:
            return MISSING
    return value


@dataclass
class Piece:
    """One tensor of the new state: its chunk, and the old ranks' chunks that cover it."""

    chunk: Chunk
    dtype: torch.dtype
    form: Any  # the new template's leaf: a Slot, or {"shard", "layout"} (its layout is kept)
    sources: list[tuple[int, Chunk]]


class Plan:
    """What this rank's state takes from which old rank's snapshot: the state's template (the new
    one, `new`) with each tensor a `Piece`, and plain values as saved."""

    def __init__(self, new: dict, olds: list[Any], local: set[int]) -> None:
        self.olds, self.local = olds, local  # old templates by old rank; old ranks this node holds
        self.pieces: list[Piece] = []
        walked = {key: self._walk(value, (key,)) for key, value in new.items()}
        self.tree = {key: value for key, value in walked.items() if value is not MISSING}
        for key, value in olds[0].items():  # saved entries the state has no place for: reported as such
            self.tree.setdefault(key, value)

    def ranks(self) -> set[int]:
        return {rank for piece in self.pieces for rank, _ in piece.sources}

    def filled(self, read: dict[int, Any]) -> dict:
        """The state to load (ett/checkpoints/state_load.py), given each needed old rank's
        snapshot, read (its template with its tensors)."""
        return _fill(self.tree, read)

    def _walk(self, new: Any, path: Path_) -> Any:
        olds = [_at(old, path) for old in self.olds]
        if (chunk := chunk_of(new)) is not None:
            return self._piece(new, chunk, path, olds) if any(chunk_of(old) for old in olds) else MISSING
        saved = [old for old in olds if old is not MISSING]
        if not saved:
            return MISSING
        if isinstance(new, dict) and new:
            walked = {key: self._walk(value, (*path, key)) for key, value in new.items()}
            kept = {key: value for key, value in walked.items() if value is not MISSING}
            # Saved entries the state no longer has, for the load to name as not restored; not the
            # entries of one old rank's own (ett.RNGState's `rank3`), as the persistent tier skips them.
            dicts = [old for old in saved if isinstance(old, dict)]
            return kept | {key: value for key, value in (dicts[0] if dicts else {}).items()
                           if key not in new and all(key in old for old in dicts)}  # fmt: skip
        if _sequence(new) and new:
            items = [self._walk(value, (*path, index)) for index, value in enumerate(new)]
            if MISSING in items or not all(_sequence(old) and len(old) == len(new) for old in saved):
                raise Unfit(f"{_name(path)}: saved with other entries than the state has")
            return type(new)(items)
        # A plain value, or an empty place (a dict or list, None) that takes what was saved whole.
        return self._whole(saved[0], path)

    def _whole(self, saved: Any, path: Path_) -> Any:
        """A saved value taken as it is, its tensors whole from the lowest old rank holding them."""
        if (chunk := chunk_of(saved)) is not None:
            if chunk.shape != chunk.whole:
                raise Unfit(f"{_name(path)}: a shard where the state has no tensor to say its layout")
            return self._piece(Slot(_slot(saved).dtype, chunk.shape), chunk, path, [_at(o, path) for o in self.olds])
        if isinstance(saved, dict):
            return {key: self._whole(value, (*path, key)) for key, value in saved.items()}
        if _sequence(saved):
            return type(saved)(self._whole(value, (*path, index)) for index, value in enumerate(saved))
        return saved

    def _piece(self, new: Any, chunk: Chunk, path: Path_, olds: list[Any]) -> Piece:
        holders: dict[Chunk, list[int]] = {}
        for rank, old in enumerate(olds):
            if (old_chunk := chunk_of(old)) is None:
                continue
            if old_chunk.whole != chunk.whole:
                raise Unfit(f"{_name(path)}: saved with shape {old_chunk.whole}, the state's is {chunk.whole}")
            holders.setdefault(old_chunk, []).append(rank)
        sources, covered = [], 0
        for old_chunk, ranks in holders.items():
            if overlap := _volume(chunk, old_chunk):
                local = [rank for rank in ranks if rank in self.local]
                sources.append((min(local or ranks), old_chunk))  # one copy of a replicated shard
                covered += overlap
        if covered != math.prod(chunk.shape):
            raise Unfit(f"{_name(path)}: the old ranks' shards cover {covered} of its "
                        f"{math.prod(chunk.shape)} elements")
        piece = Piece(chunk, _slot(olds[sources[0][0]]).dtype if sources else _slot(new).dtype, new, sources)
        self.pieces.append(piece)
        return piece


def _name(path: Path_) -> str:
    return ".".join(map(str, path))


def _slot(leaf: Any) -> Slot:
    return leaf["shard"] if isinstance(leaf, dict) else leaf


def _bounds(a: Chunk, b: Chunk) -> list[tuple[int, int]]:
    return [(max(a0, b0), min(a0 + an, b0 + bn)) for a0, an, b0, bn in zip(a.offsets, a.shape, b.offsets, b.shape,
                                                                          strict=True)]  # fmt: skip


def _volume(a: Chunk, b: Chunk) -> int:
    return math.prod(max(0, high - low) for low, high in _bounds(a, b))


def _assembled(piece: Piece, read: dict[int, Any], path: Path_) -> torch.Tensor:
    out = torch.empty(piece.chunk.shape, dtype=piece.dtype)
    for rank, old_chunk in piece.sources:
        source = _at(read[rank], path)
        source = source["shard"] if isinstance(source, dict) else source
        target = out
        for dim, (low, high) in enumerate(_bounds(piece.chunk, old_chunk)):
            target = target.narrow(dim, low - piece.chunk.offsets[dim], high - low)
            source = source.narrow(dim, low - old_chunk.offsets[dim], high - low)
        target.copy_(source)
    return out


def _fill(tree: Any, read: dict[int, Any], path: Path_ = ()) -> Any:
    if isinstance(tree, Piece):
        tensor = _assembled(tree, read, path)
        return {"shard": tensor, "layout": tree.form["layout"]} if isinstance(tree.form, dict) else tensor
    if isinstance(tree, dict):
        return {key: _fill(value, read, (*path, key)) for key, value in tree.items()}
    if _sequence(tree):
        return type(tree)(_fill(value, read, (*path, index)) for index, value in enumerate(tree))
    return tree  # a plain value; or a Slot of an entry the state has no place for, only named


def _sequence(value: Any) -> bool:
    """A list or a plain tuple: what a template's walk goes into (a NamedTuple is a value)."""
    return isinstance(value, list) or type(value) is tuple


def read(found: Found, folder: SnapshotFolder, needed: set[int], rank: int,
         group: dist.ProcessGroup | None) -> tuple[dict[int, Any], bool]:
    """A collective: each needed old rank's snapshot, read here (its node's copy, once it checks)
    or sent whole by the rank that holds it; and whether every one was its own rank's, written on
    this node (not a peer's copy, nor sent)."""
    step, read_here, fetch, own, broken = found.step, {}, [], True, ""
    for whose in sorted(needed):
        sealed = folder.seal(step, whose).exists()
        try:
            if found.sources[whose] != rank and (not folder.path(step, whose).exists()
                                                 or snapshot_mac.verify(folder, step, whose, sealed=sealed)):
                fetch.append(whose)
                continue
            read_here[whose] = snapshot_file.read(folder.path(step, whose))["state"]
            own = own and not sealed
        except (OSError, ValueError) as error:  # its holder's copy, checked, is sent instead
            if found.sources[whose] == rank:
                broken = str(error)  # said once the others are not left waiting on this rank
            else:
                fetch.append(whose)
    wanted: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(wanted, fetch, group=group)
    works, incoming = [], {}
    for requester, ranks in enumerate(wanted):
        for whose in ranks:  # sorted, as the requester posts its receives
            if found.sources[whose] == rank and requester != rank:
                data = bytearray(folder.path(step, whose).read_bytes())
                works.append(dist.isend(torch.frombuffer(data, dtype=torch.uint8), dst=requester, group=group))
    for whose in fetch:
        holder = found.sources[whose]
        incoming[whose] = torch.empty(found.offers[holder][whose][step], dtype=torch.uint8)
        works.append(dist.irecv(incoming[whose], src=holder, group=group))
    for work in works:
        work.wait()
    if broken:
        raise ValueError(broken)
    for whose, data in incoming.items():
        name = f"rank {whose}'s snapshot of step {step}"
        read_here[whose] = snapshot_file.loads(memoryview(data.numpy()), name)["state"]
    return read_here, own and not fetch


def everyone(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """A collective: whether `ok` holds on every rank."""
    flags: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, ok, group=group)
    return all(flags)


def load(found: Found, folder: SnapshotFolder, state: dict[str, Any], template: Callable[[Any], Any], rank: int,
         group: dist.ProcessGroup | None) -> tuple[LoadReport, bool] | str:
    """A collective: loads the snapshots `found` into `state`, resharded; returns what did not
    match and whether every snapshot this rank read was its node's own; or why it could not, on
    every rank alike, nothing of `state` loaded."""
    # An optimizer not stepped yet is given its state, as DCP's get_state_dict does, so its moments
    # have a place; on every rank alike, first: under FSDP2 that may take collectives.
    for value in state.values():
        if hasattr(value, "local_state"):
            value.state_dict()
    mine, why = {}, ""
    try:  # each old rank's template, from the rank whose node's copy was chosen
        mine = {whose: snapshot_file.read_header(folder.path(found.step, whose))["state"]
                for whose, holder in found.sources.items() if holder == rank}  # fmt: skip
    except (OSError, ValueError, KeyError, pickle.UnpicklingError) as error:
        why = f"a snapshot's header could not be read: {error}"
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    plan = None
    if not why:
        try:
            olds = [next(headers[whose] for headers in gathered if whose in headers)
                    for whose in range(found.world_size)]  # fmt: skip
            local = {whose for whose in range(found.world_size) if folder.path(found.step, whose).exists()}
            plan = Plan(template(state), olds, local)
        except (Unfit, StopIteration) as error:
            why = str(error) or "an old rank's snapshot was not read"
    if not everyone(not why, group):
        return why or "another rank could not"
    try:
        read_here, own = read(found, folder, plan.ranks(), rank, group)
        saved = plan.filled(read_here)
    except (ValueError, KeyError, RuntimeError) as error:
        why = f"it could not be read: {error}"
    if not everyone(not why, group):
        return why or "another rank could not"
    return load_saved(state, saved), own  # as a snapshot of this size is: its shapes are this state's


def forget_newer_than(local_dir: str, world_size: int, step: int) -> None:
    """This node's snapshots of other world sizes past a resumed step: another timeline's, as the
    same size's are (LocalSnapshots.forget_newer_than). No rank of another size runs any more."""
    for size in other_sizes(local_dir, world_size):
        folder = SnapshotFolder(snapshots_root(local_dir, size))
        for whose in range(size):
            folder.forget_newer_than(whose, step)
