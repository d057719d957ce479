"""The fast tier: a snapshot of each rank's own state on node-local disk, as often as every step.

A persistent checkpoint (DCP, `checkpoint.dir`) is written every `interval_steps` and survives any
node; a failure between two of them loses up to `interval_steps` steps. Between them, each rank
keeps its own shard of the state (model and optimizer shards, data position, generators, step)
in `<local_dir>/snapshots/w<world>/step-N/rank-R.snap` (ett/snapshots/file_format.py): a copy into CPU
buffers kept from snapshot to snapshot at the step's end, written by a background thread, renamed
into place once whole. No collective is involved, so a snapshot costs the training loop its copy
and the CPU its write takes (on a busy node the write competes with the steps for it: its wall
time, stretched by that, is not the cost). When the two take more than `MAX_SHARE` of the steps
between two snapshots, the rank snapshots every 2nd, 4th, ... step instead (powers of two, so
ranks that chose differently still share steps), and back again once they cost far less
(`next_every`).

On a job of several nodes each snapshot also goes to a peer on another node (ett/snapshots/peers.py),
so a lost node's ranks can take their state from their peers' copies. On restart the ranks agree
on the newest step of which every rank's snapshot exists and verifies, on its own node or a
peer's (ett/snapshots/restore.py); nothing partial is ever loaded. The same world size and shard
layout are needed, which the scheduler keeps by giving an attempt its previous nodes in their old
rank order (a lost node's replacement in its place). The checkpointer (ett/checkpoint.py) loads
the newer of that snapshot and the persistent checkpoint.
"""

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ett.snapshots import file_format as snapshot_file
from ett.snapshots import reshard
from ett.snapshots import restore as snapshot_restore
from ett.snapshots.file_format import Slot, StagingBuffer
from ett.snapshots.folder import SnapshotFolder, snapshots_root
from ett.snapshots.peers import PeerReplica
from ett.state import is_stateful, shard_layout
from ett.checkpoints.nested import lifted
from ett.checkpoints.state_load import LoadReport, load_saved

logger = logging.getLogger(__name__)
MAX_SHARE = 0.05  # of a step's time, for the copy a snapshot costs the training loop
MAX_EVERY = 64
FLUSH_SECONDS = 5.0  # at the run's end, for the last snapshot's copy to reach the peer


def template(value: Any, found: list[tuple[Slot, torch.Tensor]]) -> Any:
    """What a snapshot holds of `value`, each tensor (a DTensor: its local shard) replaced by its
    Slot, both appended to `found`, not copied; model and optimizer through their `local_state`
    (ett/state.py), other Stateful objects through their state_dict."""
    if isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):  # its shard, with where it lies in the whole (ett/snapshots/reshard.py)
            local, layout = value._local_tensor, shard_layout(value)  # see ett/state.py _local
        else:
            local, layout = value, None
        slot = Slot(local.dtype, tuple(local.shape), layout)
        found.append((slot, local))  # copied under no_grad: no detach needed
        return slot
    if isinstance(value, dict):
        return {key: template(item, found) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(template(item, found) for item in value)
    if hasattr(value, "local_state"):
        return template(value.local_state(), found)
    if is_stateful(value):
        return template(value.state_dict(), found)
    return value


def next_every(every: int, cost: float, step_seconds: float, previous_cost: float | None = None) -> int:
    """The cadence after a snapshot that cost `cost` seconds, with steps of `step_seconds`: doubled
    when it took more than MAX_SHARE of the steps between two snapshots, halved when half the
    cadence would still take at most half of that (a passing stall, such as a background
    checkpoint write, then costs steps lost only while it lasts, and the cadence never swings).
    With the snapshot before it (`previous_cost`), the cheaper of the two decides: one slow write
    (a stall beside the persistent tier's write) does not double the cadence, two in a row do."""
    if previous_cost is not None:
        cost = min(cost, previous_cost)
    if cost > MAX_SHARE * step_seconds * every and every < MAX_EVERY:
        return every * 2
    if every > 1 and cost < MAX_SHARE * step_seconds * every / 4:
        return every // 2
    return every


class LocalSnapshots:
    """One rank's fast tier. `replicate`: on a job of several nodes, each snapshot also goes to
    `copies` peer nodes (made with every rank at once: a collective on `group`)."""

    def __init__(self, local_dir: str, rank: int, world_size: int, every: int = 0, replicate: bool = False,
                 group: dist.ProcessGroup | None = None, copies: int = 1) -> None:
        self.folder = SnapshotFolder(snapshots_root(local_dir, world_size))
        self.local_dir, self.world_size, self.rank = local_dir, world_size, rank
        self.adaptive = every == 0  # else fixed at `every`
        self.every = every or 1
        self.staging = StagingBuffer()  # reused: one write at a time
        # One thread for the writes, kept: starting one per snapshot took 0.7 ms of the loop's time.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ett-snapshot")
        self._writing: Future | None = None
        self._last_call: float | None = None
        self._write_cpu_seconds = 0.0  # the last write's CPU time, which a busy node's steps lose
        self._last_cost: float | None = None  # the snapshot before's copy and write
        self.peers = PeerReplica.join(self.folder, group, copies) if replicate else None
        # The ranks whose snapshots this node holds: this one's, and the peers' whose copies it keeps.
        self.held = {rank} | (self.peers.keeps_for if self.peers is not None else set())
        self._peer_cpu_counted = 0.0
        self.restored_from = ""  # after a restore: "local-snapshot" or "peer-snapshot" (a peer's copy)

    def maybe_save(self, step: int, state: dict[str, Any]) -> bool:
        """Snapshots this rank's state after `step` when its cadence says so; True when it did."""
        now = time.perf_counter()
        step_seconds = now - self._last_call if self._last_call is not None else None
        self._last_call = now
        if step % self.every:
            return False
        if self._writing is not None:  # one write at a time (the buffers are reused); its wait counts below
            self._writing.result()
        found: list[tuple[Slot, torch.Tensor]] = []
        # Pickled now: the loop may change any value of the state once we return.
        # Lifted only when one is taken (ett/checkpoints/nested.py): a walk of the whole state, not for every step.
        header = snapshot_file.header({"step": step, "state": template(lifted(state), found)})
        buffer = self.staging.copy(found)
        cost = time.perf_counter() - now + self._write_cpu_seconds + self._peer_cpu_seconds()
        previous_cost, self._last_cost = self._last_cost, cost
        if self.adaptive and step_seconds and (every := next_every(self.every, cost, step_seconds,
                                                                    previous_cost)) != self.every:
            self.every = every
            logger.info("local snapshots every %d steps: a copy and write take %.1f ms, a step %.1f ms", self.every,
                        cost * 1e3, step_seconds * 1e3)
        self._writing = self._writer.submit(self._write, step, header, buffer)
        return True

    def _peer_cpu_seconds(self) -> float:
        """The CPU this rank's copies to and from its peers took since the last call."""
        if self.peers is None:
            return 0.0
        total = self.peers.cpu_seconds
        since, self._peer_cpu_counted = total - self._peer_cpu_counted, total
        return since

    def _write(self, step: int, header: bytes, buffer: torch.Tensor) -> None:
        started = time.thread_time()
        try:
            staging = self.folder.staging(step, self.rank, "own")
            with open(staging, "wb") as file:
                snapshot_file.write(file, header, buffer)
            target = self.folder.place(staging, step, self.rank)
        except OSError as error:  # a full or lost local disk: the persistent tier still holds
            logger.warning("local snapshot of step %d not written: %s", step, error)
        else:
            self.folder.prune(self.rank)
            if self.peers is not None:
                self.peers.offer(step, target)
        self._write_cpu_seconds = time.thread_time() - started

    def wait(self) -> None:
        if self._writing is not None:
            self._writing.result()

    def close(self) -> None:
        self.wait()
        self._writer.shutdown()
        if self.peers is not None:
            self.peers.flush(timeout=FLUSH_SECONDS)  # the last snapshot's copy, unless its peer is gone
            self.peers.close()

    def steps(self) -> list[int]:
        """The steps this rank holds a whole snapshot of on its node, newest first."""
        return self.folder.steps(self.rank)

    def restore_step(self, group: dist.ProcessGroup | None) -> int | None:
        """A collective: the newest step of which every rank's snapshot exists and verifies, on its
        node or a peer's; after it each rank's own node holds its snapshot of that step (fetched
        from the peer when needed). None when there is no such step."""
        step, sources, offers = snapshot_restore.agree(self.folder, self.rank, self.held, group)
        if dist.get_rank(group) == 0:  # why a restart did or did not resume from this tier
            from_peers = sorted(whose for whose, holder in sources.items() if holder != whose)
            logger.info("local snapshots: resuming from step %s%s; each rank's offer (whose state: steps): %s", step,
                        f", ranks {from_peers} from their peers' copies" if from_peers else "",
                        [{whose: sorted(steps, reverse=True) for whose, steps in offer.items()} for offer in offers])
        if step is None:
            return None
        snapshot_restore.fetch(self.folder, step, sources, offers, self.rank, group)
        self.restored_from = "local-snapshot" if sources[self.rank] == self.rank else "peer-snapshot"
        return step

    def find_other_size(self, group: dist.ProcessGroup | None) -> reshard.Found | None:
        """A collective: the newest step of which every rank's snapshot at another world size is
        held, for an elastic run at a new size (ett/snapshots/reshard.py)."""
        return reshard.find(self.local_dir, self.world_size, self.rank, group)

    def load_other_size(self, found: reshard.Found, state: dict[str, Any],
                        group: dist.ProcessGroup | None) -> LoadReport | None:
        """A collective: loads the snapshots `found` into `state`, resharded to this run's size;
        None (on every rank alike) when they do not fit it, `state` untouched."""
        folder = SnapshotFolder(snapshots_root(self.local_dir, found.world_size))
        loaded = reshard.load(found, folder, state, lambda value: template(value, []), self.rank, group)
        if isinstance(loaded, str):
            logger.warning("the snapshot of step %d taken at %d ranks not loaded at %d: %s", found.step,
                           found.world_size, self.world_size, loaded)
            return None
        report, own = loaded
        self.restored_from = "local-snapshot" if own else "peer-snapshot"
        return report

    def load(self, step: int, state: dict[str, Any]) -> LoadReport:
        """Loads this rank's snapshot of `step` into `state`, in place, by the rules every tier
        shares (ett/checkpoints/state_load.py); returns what did not match."""
        return load_saved(state, snapshot_file.read(self.folder.path(step, self.rank))["state"])

    def forget_newer_than(self, step: int) -> None:
        """Snapshots past the resumed step belong to an abandoned timeline: this rank's, and the
        copies it keeps for its peer."""
        for whose in self.held:
            self.folder.forget_newer_than(whose, step)
