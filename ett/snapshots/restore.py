"""Which step a restart resumes from the fast tier, and from which copy each rank takes its state.

Every rank offers the snapshots its node holds of itself and, with replication, of the rank it
keeps copies for (ett/snapshots/peers.py). The ranks agree on the newest step of which every
rank's snapshot is offered by someone: a rank takes its own copy when its node has one, else the
copy its peer keeps (a lost node's replacement). Before the choice stands, each copy chosen is
verified by its holder (the CRC-32 of ett/snapshots/file_format.py and, for a peer's copy, its seal: the
proof it passed its MAC on arrival, ett/snapshots/mac.py); one torn, corrupt or without a matching
seal is removed and the choice is made again without it: the next copy of the same step, else an
older step, else none (the checkpointer then reads the persistent tier). So no peer's copy is
unpickled unverified. Copies then move holder to rank over the checkpointer's own process group
(the job's channel, whose collectives unpickle already), and are written to the rank's node-local
folder, as its own snapshot, before loading.
"""

import logging

import torch
import torch.distributed as dist

from ett.snapshots import mac as snapshot_mac
from ett.snapshots.folder import SnapshotFolder

logger = logging.getLogger(__name__)

Offer = dict[int, dict[int, int]]  # rank whose state it is -> {step: the file's size}


def choose(offers: list[Offer], world_size: int) -> tuple[int | None, dict[int, int]]:
    """The newest step of which every rank's snapshot is offered, and for each rank the rank that
    gives it: itself when it holds one, else the lowest holder. (None, {}) when there is no such step."""
    holders: dict[tuple[int, int], list[int]] = {}
    for holder, offer in enumerate(offers):
        for rank, steps in offer.items():
            for step in steps:
                holders.setdefault((rank, step), []).append(holder)
    for step in sorted({step for _, step in holders}, reverse=True):
        if all((rank, step) in holders for rank in range(world_size)):
            return step, {rank: rank if rank in holders[rank, step] else min(holders[rank, step])
                          for rank in range(world_size)}  # fmt: skip
    return None, {}


def offer(folder: SnapshotFolder, ranks: set[int] | range) -> Offer:
    """The snapshots of `ranks` this node holds in `folder`, with their sizes."""
    found: Offer = {}
    for rank in ranks:
        for step in folder.steps(rank):
            try:
                found.setdefault(rank, {})[step] = folder.path(step, rank).stat().st_size
            except FileNotFoundError:
                continue
    return found


def agree(folder: SnapshotFolder, rank: int, held: set[int] | range, group: dist.ProcessGroup | None,
          saved_world_size: int | None = None) -> tuple[int | None, dict[int, int], list[Offer]]:
    """A collective: the step to resume from (None: the fast tier has none), who gives each rank
    its copy, and every rank's offer. Copies that do not verify are removed on the way.
    `saved_world_size`: the snapshots were taken at that many ranks, not this run's
    (ett/snapshots/reshard.py): each node offers every rank's it holds, and which of them are
    peers' copies (to be checked against their seals) their seals say, as no rank here is theirs."""
    world_size = saved_world_size or dist.get_world_size(group)
    while True:
        offers: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(offers, offer(folder, held), group=group)
        step, sources = choose(offers, world_size)
        refused = []
        for whose, holder in sources.items():
            sealed = folder.seal(step, whose).exists() if saved_world_size else whose != rank
            if holder == rank and (why := snapshot_mac.verify(folder, step, whose, sealed=sealed)):
                logger.warning("snapshot %s of rank %d refused: %s", folder.path(step, whose), whose, why)
                folder.remove(step, whose)
                refused.append(whose)
        everyone_refused: list = [None] * len(offers)
        dist.all_gather_object(everyone_refused, refused, group=group)
        if not any(everyone_refused):  # each round removes a copy: the loop ends
            return step, sources, offers


def fetch(folder: SnapshotFolder, step: int, sources: dict[int, int], offers: list[Offer], rank: int,
          group: dist.ProcessGroup | None) -> None:
    """A collective: each rank whose own node holds no copy of `step` receives it from its holder,
    point to point, and writes it to its node-local folder (renamed into place whole)."""
    works, incoming = [], None
    for whose, holder in sorted(sources.items()):
        if holder == whose:
            continue
        if holder == rank:
            data = bytearray(folder.path(step, whose).read_bytes())
            works.append(dist.isend(torch.frombuffer(data, dtype=torch.uint8), dst=whose, group=group))
        elif whose == rank:
            incoming = torch.empty(offers[holder][whose][step], dtype=torch.uint8)
            works.append(dist.irecv(incoming, src=holder, group=group))
    for work in works:
        work.wait()
    if incoming is not None:
        staging = folder.staging(step, rank, "fetched")
        staging.write_bytes(memoryview(incoming.numpy()))
        folder.place(staging, step, rank)
