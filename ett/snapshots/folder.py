"""Where a node keeps snapshots: `<local_dir>/snapshots/w<world>/step-N/rank-R.snap`.

A node holds the snapshots of its own ranks and, with replication (ett/snapshots/peers.py), the
copies its ranks keep for the ranks of the node before it in the ring. Both are named by the rank
whose state they hold, not by who wrote them, so a restart finds a rank's state by its rank
whichever node now runs it. A peer's copy has its seal beside it, `step-N/rank-R.seal`: the proof
that it passed its MAC on arrival, checked before a restore takes it (ett/snapshots/mac.py).
"""

import contextlib
import os
import shutil
from pathlib import Path

KEEP = 2  # whole snapshots kept per rank: the newest may be torn by a kill on another rank


def snapshots_root(local_dir: str | Path, world_size: int) -> Path:
    return Path(local_dir) / "snapshots" / f"w{world_size}"


class SnapshotFolder:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, step: int, rank: int) -> Path:
        return self.root / f"step-{step:08d}" / f"rank-{rank}.snap"

    def seal(self, step: int, rank: int) -> Path:
        return self.path(step, rank).with_suffix(".seal")

    def staging(self, step: int, rank: int, writer: str) -> Path:
        """Where `writer` ("own", "peer", "fetched") writes a snapshot before `place` puts it in:
        a folder no pruning removes (a step's folder goes once its last snapshot does, and a copy
        of an older step may arrive while its own rank prunes it)."""
        incoming = self.root / "incoming"
        incoming.mkdir(parents=True, exist_ok=True)
        return incoming / f"step-{step:08d}-rank-{rank}.{writer}"

    def place(self, staging: Path, step: int, rank: int, seal: bytes | None = None) -> Path:
        """Renames a whole snapshot into its step's folder (whole, or not there); a peer's copy
        with its `seal`, written first: a copy in place has its seal (one that lost it to a racing
        prune is refused at restore, never taken without)."""
        target, tries_left = self.path(step, rank), 2
        while True:  # a prune of the folder's last snapshot may remove it in between: made again
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                if seal is not None:
                    self.seal(step, rank).write_bytes(seal)
                os.replace(staging, target)
                return target
            except FileNotFoundError:
                if not tries_left or not staging.exists():
                    raise
                tries_left -= 1

    def steps(self, rank: int) -> list[int]:
        """The steps this node holds a snapshot of `rank` of, newest first (written whole: renamed
        into place; whether it verifies is ett.snapshots.file_format.verify's to say)."""
        found = []
        for folder in self.root.glob("step-*"):
            if (folder / f"rank-{rank}.snap").exists():
                try:
                    found.append(int(folder.name.removeprefix("step-")))
                except ValueError:
                    continue
        return sorted(found, reverse=True)

    def remove(self, step: int, rank: int) -> None:
        """Removes one snapshot; the last one out removes the step's folder. Other ranks of the node
        (and their peers' receivers) share the folders and may remove one meanwhile."""
        self.path(step, rank).unlink(missing_ok=True)
        self.seal(step, rank).unlink(missing_ok=True)
        folder = self.path(step, rank).parent
        with contextlib.suppress(FileNotFoundError):
            if not any(folder.glob("rank-*.snap")):
                shutil.rmtree(folder, ignore_errors=True)

    def prune(self, rank: int, keep: int = KEEP) -> None:
        """Keeps the newest `keep` snapshots of `rank`."""
        for old in self.steps(rank)[keep:]:
            self.remove(old, rank)

    def forget_newer_than(self, rank: int, step: int) -> None:
        """Snapshots of `rank` past a resumed step belong to an abandoned timeline, and what a
        killed writer left half written of it in the staging folder is nobody's."""
        for newer in [s for s in self.steps(rank) if s > step]:
            self.remove(newer, rank)
        for left in (self.root / "incoming").glob(f"step-*-rank-{rank}.*"):
            left.unlink(missing_ok=True)
