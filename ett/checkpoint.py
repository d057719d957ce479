"""Asynchronous DCP checkpoints with an atomic commit marker, retention and verified resume.

Layout and commit (ett/checkpoints/folders.py): `<dir>/step-00000040/` holds DCP's shard files
(`__<rank>_<i>.distcp`), its `.metadata` and, written last, `COMMITTED`: a manifest (step, world
size, size and CRC-32 of every file). Resume takes the newest folder that verifies.

Saving copies the state to CPU memory (staging, ett/checkpoints/staging.py): everything at once
but the parameters and optimizer state of a `ModelOptimizerState`, which are copied in a
background thread overlapped with the next step's forward and backward; the loop waits for
them with `wait_for_staging()` before `optimizer.step`. DCP then writes in the background, from
a thread or a checkpoint process (ett/checkpoints/writer.py). When the write finishes on every
rank (DCP's coordinator writes `.metadata` after gathering every rank's write result, and every
file is fsynced), rank 0 writes the marker and prunes old ones.

With `local_dir` (node-local fast disk), DCP writes there first and the ranks then copy the files
to `dir` in the background before the marker is written (ett/checkpoints/tiers.py); `dir`
stays the checkpoint of record, and resume reads the local copies that match its manifest.
"""

import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ett.checkpoints.staging import ReusedBufferStager
from ett.checkpoints.tiers import TieredReader, gather_manifest
from ett.checkpoints.writer import ASYNC_MODES, agree_on_mode, stop_checkpoint_process
from ett.errors import UsageError
from ett.events import EventWriter
from ett.checkpoints.folders import (
    MARKER,
    first_verified,
    prune,
    read_manifest,
    resume_candidates,
    step_folder,
    step_folders,
    step_of,
    write_marker,
)
from ett.protocol import JobEnv
from ett.snapshots import reshard
from ett.snapshots.tier import LocalSnapshots
from ett.state import ModelOptimizerState, is_stateful
from ett.checkpoints import rank_values
from ett.checkpoints.planners import ReportingLoadPlanner, TypedPathsSavePlanner
from ett.checkpoints.rank_values import REPORTED_KEYS
from ett.checkpoints.nested import lifted, put_back
from ett.checkpoints.state_load import LoadReport

logger = logging.getLogger(__name__)


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: no checkpoints are saved
    # Node-local fast folder: saves land here first and are copied to `dir` in the background;
    # resume reads the files here that match the checkpoint's manifest. Empty: `dir` only.
    local_dir: str = ""
    interval_steps: int = 0  # save every N steps; 0: only when forced (the trainer: its last step, SIGTERM)
    keep: int = 3  # newest committed checkpoints kept
    resume_from: str = "auto"  # "auto": newest in dir that verifies | "none" | a step folder
    # Where DCP writes in the background: "auto" | "process" | "thread" (ett/checkpoints/writer.py).
    async_mode: str = "auto"
    # Threads (and files) per rank that DCP writes with. DCP's own default is 1: 0.74-0.84 GiB/s
    # against 1.55 with 4 on the H100 machine of BENCHMARKS.md ("GPU checks").
    write_threads: int = 4
    # With local_dir: each rank also snapshots its own state there after every step (the fast
    # tier, ett/snapshots/tier.py); a restart resumes from the newer of it and the persistent tier.
    # Default: $ETT_CHECKPOINT_SNAPSHOTS == "1" (the job's `checkpoint.snapshots`).
    snapshots: bool = field(default_factory=lambda: os.environ.get(JobEnv.CHECKPOINT_SNAPSHOTS) == "1")
    snapshot_every: int = 0  # 0: every step its cost allows (ett/snapshots/tier.py); N: every N steps, fixed
    # On a job of several nodes, each snapshot also goes to a peer node (ett/snapshots/peers.py), so
    # a lost node's ranks resume from their peers' copies. False: each node keeps its own only.
    snapshot_peers: bool = True
    # How many peer nodes keep a copy of each snapshot (the next ones of the ring): that many
    # neighbouring nodes may be lost at once. Default: $ETT_CHECKPOINT_SNAPSHOT_COPIES, else 1.
    snapshot_copies: int = field(default_factory=lambda: int(os.environ.get(JobEnv.CHECKPOINT_SNAPSHOT_COPIES) or 1))
    # A new interval handed to a running job (`interval_steps: "auto"`, retuned by the service):
    # "<interval_steps> <from_step>", looked at by every `due`. Empty: none.
    interval_file: str = field(default_factory=lambda: os.environ.get(JobEnv.CHECKPOINT_INTERVAL_FILE, ""))

    def due(self, step: int, last_step: int | None = None) -> bool:
        """Whether a save is due after `step`: at the interval, or at `last_step` (when known)."""
        if self.interval_file:
            live = self.__dict__.setdefault("_live_interval", IntervalFile(self.interval_file))
            self.interval_steps = live.interval_at(step, self.interval_steps)
        interval = self.interval_steps
        return bool(self.dir) and (step == last_step or (interval > 0 and step % interval == 0))

    def validate(self) -> None:
        if self.interval_steps < 0:
            raise UsageError(f"checkpoint.interval_steps must be >= 0, got {self.interval_steps}")
        if self.keep < 1:
            raise UsageError(f"checkpoint.keep must be >= 1, got {self.keep}")
        if self.snapshot_copies < 1:
            raise UsageError(f"checkpoint.snapshot_copies must be >= 1, got {self.snapshot_copies}")
        if self.write_threads < 1:
            raise UsageError(f"checkpoint.write_threads must be >= 1, got {self.write_threads}")
        if self.resume_from not in ("auto", "none") and step_of(Path(self.resume_from)) is None:
            raise UsageError(
                f"checkpoint.resume_from must be auto, none or a step-NNNNNNNN folder, got {self.resume_from!r}")
        if self.async_mode not in ASYNC_MODES:
            raise UsageError(f"checkpoint.async_mode must be 'auto', 'process' or 'thread', got {self.async_mode!r}")
        if self.local_dir and (not self.dir or Path(self.local_dir).resolve() == Path(self.dir).resolve()):
            raise UsageError("checkpoint.local_dir needs checkpoint.dir, and another folder: the local copy caches it")


class IntervalFile:
    """A running job's new checkpoint intervals, as its agent writes them (whole, by a rename): one
    "<interval_steps> <from_step>" line per change, in the order the service made them. Every rank
    applies each from its own step, so their collective saves stay in step, even when two changes
    arrive before the first one's step (the file keeps both). It is read again only when it changes
    (one stat a step)."""

    def __init__(self, path: str) -> None:
        self.path, self._version = path, None
        self._changes: list[tuple[int, int]] = []  # (interval_steps, from_step)

    def interval_at(self, step: int, interval: int) -> int:
        try:
            version = os.stat(self.path).st_mtime_ns
        except OSError:
            version = None
        if version is not None and version != self._version:
            self._version = version
            try:
                lines = Path(self.path).read_text().splitlines()
                self._changes = [(int(new), int(from_step)) for new, from_step in (line.split()[:2] for line in lines)]
            except (OSError, ValueError):
                pass  # not written whole: read it again when it changes
        in_force = [new for new, from_step in self._changes if from_step <= step]
        if in_force and in_force[-1] != interval:
            logger.info("checkpoint interval %d from step %d (was %d)", in_force[-1], step, interval)
            interval = in_force[-1]
        return interval


def find_resume_folder(cfg: CheckpointConfig) -> Path | None:
    """The newest committed checkpoint that verifies: from `dir` ("auto"), or the given folder,
    falling back to older ones beside it. Each one skipped is logged with its reason."""
    if cfg.resume_from == "none":
        return None
    return first_verified(resume_candidates(cfg.dir, None if cfg.resume_from == "auto" else cfg.resume_from))


class Checkpointer:
    """Saves and restores one job's checkpoints; every rank makes one and calls it alike."""

    def __init__(self, cfg: CheckpointConfig, events: EventWriter):
        self.cfg, self.events = cfg, events
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # One rank per node looks after the node's local folder (retention, abandoned steps).
        self.tends_local_dir = bool(cfg.local_dir) and int(os.environ.get("LOCAL_RANK", "0")) == 0
        # DCP's own collectives run in a background thread (or process): they get a group of
        # their own, so they never interleave with the training loop's on the default group.
        self.group = dist.new_group(backend="gloo")
        # The mode is chosen by the first save, from the size of the state (agree_on_mode), before
        # the stager allocates its buffers (shared memory or not); they are reused by every later
        # save. Parameters and optimizer state are copied in the background until wait_for_staging().
        self.mode: AsyncCheckpointerType | None = None
        self.stager = ReusedBufferStager(share_memory=False, pin_memory=torch.cuda.is_available())
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ett-ckpt-commit")
        # Old checkpoints are deleted beside the next save, not before it: removing a 14 GiB one
        # took 5 s on the GPU machine of BENCHMARKS.md, and the next save waits for the commit.
        self.pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ett-ckpt-prune")
        self.in_flight: Future | None = None  # the last save, until committed (or failed)
        self.snapshots = (LocalSnapshots(cfg.local_dir, self.rank, self.world_size, cfg.snapshot_every,
                                         replicate=cfg.snapshot_peers, group=self.group, copies=cfg.snapshot_copies)
                          if cfg.local_dir and cfg.snapshots else None)  # fmt: skip

    def save(self, step: int, state: dict) -> bool:
        """Blocks for the copy of everything but the parameters and optimizer state, whose copy
        goes on until wait_for_staging(); the write and the commit follow in the background.
        False when the save could not even start (a `ckpt_failed` event says why)."""
        self.events.emit("ckpt_start", step=step)
        state = lifted(state)  # a Stateful below the top saved as one at the top (ett/checkpoints/nested.py)
        self.wait()  # the stager reuses its CPU buffers: the previous save must be written first
        folder = step_folder(self.cfg.dir, step)
        # With a local tier, DCP writes to node-local disk without fsync: the copy to `folder` is the durable one.
        target = step_folder(self.cfg.local_dir, step) if self.cfg.local_dir else folder
        try:
            # DCP's own first step, done here once: each Stateful's state_dict, which the choice of the
            # writer and the check of what differs between ranks read too (ett/checkpoints/rank_values.py).
            saved = {key: value.state_dict() if is_stateful(value) else value for key, value in state.items()}
            if self.mode is None:
                self.mode = agree_on_mode(self.cfg.async_mode, saved, self.group)
                self.stager.share_memory = self.mode == AsyncCheckpointerType.PROCESS
            self.stager.copy_in_background(t for s in state.values() if isinstance(s, ModelOptimizerState)
                                           for t in s.changed_only_by_optimizer_step())  # fmt: skip
            if self.rank == 0:  # a folder left by an abandoned run is rewritten: uncommit it first
                folder.mkdir(parents=True, exist_ok=True)
                (folder / MARKER).unlink(missing_ok=True)
            digests = rank_values.digests(saved, skip={k for k, v in state.items() if isinstance(v, ModelOptimizerState)})
            writer = FileSystemWriter(target, sync_files=not self.cfg.local_dir, thread_count=self.cfg.write_threads,
                                      overwrite=True)
            response = dcp.async_save(
                saved, storage_writer=writer, process_group=self.group, async_checkpointer_type=self.mode,
                async_stager=self.stager, planner=TypedPathsSavePlanner(),
            )  # fmt: skip
        except Exception as error:
            logger.exception("checkpoint of step %d failed while staging", step)
            self.events.emit("ckpt_failed", step=step, error=repr(error))
            return False
        # The training loop goes on from here (ckpt_staged ends a save's blocking part, docs/events.md);
        # the background copy is done by its next optimizer.step.
        self.events.emit("ckpt_staged", step=step)
        self.events.writing(True)  # until committed or failed: steps are slower meanwhile (agent/groups/hang.py)
        self.in_flight = self.committer.submit(self._commit, response.upload_completion, step, folder, digests)
        return True

    def snapshot(self, step: int, state: dict) -> None:
        """The fast tier after `step` (ett/snapshots/tier.py): call it at every step's end; it keeps to
        its own cadence and never blocks on a write."""
        if self.snapshots is not None:
            self.snapshots.maybe_save(step, state)

    def wait_for_staging(self) -> None:
        """Block until the last save's copy of the state is done: call it before anything
        changes parameters or optimizer state (optimizer.step, a load)."""
        self.stager.wait_for_copies()

    def _commit(self, upload: Future, step: int, folder: Path, digests: dict[str, int]) -> None:
        try:
            # A failed background copy fails the upload too, which raises below on every rank
            # (gather_manifest's collective is reached all the same): no commit.
            written = step_folder(self.cfg.local_dir, step) if self.cfg.local_dir else folder
            gathered = gather_manifest(upload, written, folder, self.group, digests)
            if gathered is not None:  # rank 0
                files, differs = gathered
                if differs:
                    logger.warning("checkpoint of step %d: %s", step, rank_values.describe(differs))
                nbytes = write_marker(folder, step, self.world_size, files, **{rank_values.MANIFEST_KEY: differs})
                self.events.emit("ckpt_committed", step=step, path=str(folder), bytes=nbytes,
                                 **({rank_values.MANIFEST_KEY: differs[:REPORTED_KEYS]} if differs else {}))
                logger.info("checkpoint %s committed (%.1f MiB)", folder, nbytes / 2**20)
        except Exception as error:
            logger.exception("checkpoint of step %d failed", step)
            self.events.emit("ckpt_failed", step=step, error=repr(error))
        else:
            try:
                self.pruner.submit(self._prune, step)
            except RuntimeError:  # the process is ending (a script that raised): a later save prunes
                logger.info("old checkpoints not pruned after step %d: the process is ending", step)
        finally:
            self.events.writing(False)

    def _prune(self, committed_step: int) -> None:
        """After the commit of `committed_step`: the newest `keep` committed checkpoints stay (older
        torn ones go too), and as many saves up to it in the node's local folder, enough to resume
        from any checkpoint kept. The next save may be in progress: it is newer, and never touched."""
        try:
            if self.tends_local_dir:
                saved = [f for f in step_folders(self.cfg.local_dir) if step_of(f) <= committed_step]
                for old in saved[self.cfg.keep :]:
                    shutil.rmtree(old, ignore_errors=True)
            if self.rank == 0:
                prune(self.cfg.dir, self.cfg.keep)
        except Exception:
            logger.exception("removing old checkpoints failed")

    def wait(self) -> None:
        """Block until the save in flight is committed (or has failed)."""
        if self.in_flight is not None:
            self.in_flight.result()
            self.in_flight = None

    def restore(self, state: dict, other_sizes: bool = False) -> tuple[int, LoadReport]:
        """Load the checkpoint to resume from into `state` (see _restore), a Stateful below its top through its
        own load_state_dict (ett/checkpoints/nested.py)."""
        handed = lifted(state)
        restored = self._restore(handed, other_sizes)
        put_back(state, handed)
        return restored

    def _restore(self, state: dict, other_sizes: bool = False) -> tuple[int, LoadReport]:
        """Load the checkpoint to resume from into `state`, from whichever tier holds the newest
        (ett/checkpoints/state_load.py's rules for all); returns its step (0: none) and what did not match:
        saved entries `state` has no place for, and entries of `state` the checkpoint lacks.
        `other_sizes`: an elastic run's (ett/elastic.py), whose state is the same at any world size,
        loads a checkpoint saved at another, resharded: a persistent one by DCP, the fast tier's
        snapshots (kept per world size, ett/snapshots/folder.py) by ett/snapshots/reshard.py."""
        self.wait_for_staging()
        chosen = [None]
        if self.rank == 0:
            folder = find_resume_folder(self.cfg)
            chosen = [str(folder) if folder else None]
        dist.broadcast_object_list(chosen, src=0, group=self.group)
        persistent = step_of(Path(chosen[0])) if chosen[0] else 0
        local = self._newest_snapshot()
        other = (self.snapshots.find_other_size(self.group)
                 if other_sizes and self.snapshots is not None and self.cfg.resume_from != "none" else None)
        started = False
        if other is not None and other.step > max(local or 0, persistent):
            self.events.emit("restore_start")
            started = True
            report = self.snapshots.load_other_size(other, state, self.group)
            if report is not None:
                return self._restored(other.step, self.snapshots.restored_from, report,
                                      saved_world_size=other.world_size), report
        if local is not None and local > persistent:
            if not started:
                self.events.emit("restore_start")
            report = self.snapshots.load(local, state)
            return self._restored(local, self.snapshots.restored_from, report), report
        if chosen[0] is None:
            self._retire_newer_than(0)
            return 0, LoadReport()
        folder = Path(chosen[0])
        manifest = read_manifest(folder)
        resharded = manifest["world_size"] != self.world_size
        if resharded and not other_sizes:
            raise UsageError(f"checkpoint.resume_from: {folder} was written by {manifest['world_size']} ranks, "
                              f"this run has {self.world_size}; the data position and RNG states are per rank")
        if not started:
            self.events.emit("restore_start")
        local = step_folder(self.cfg.local_dir, step_of(folder)) if self.cfg.local_dir else None
        reader = TieredReader(folder, local, manifest["files"])
        planner = ReportingLoadPlanner(self.rank)
        dcp.load(state, storage_reader=reader, planner=planner, process_group=self.group)
        planner.report.differed = manifest.get(rank_values.MANIFEST_KEY, [])
        logger.info("resumed from %s: %s (local %d bytes, persistent %d bytes)", folder, reader.source,
                    reader.bytes_read["local"], reader.bytes_read["persistent"])
        if resharded:
            logger.warning("the checkpoint of step %d was saved by %d ranks, loaded resharded by %d",
                           manifest["step"], manifest["world_size"], self.world_size)
        saved_at = {"saved_world_size": manifest["world_size"]} if resharded else {}
        return self._restored(manifest["step"], reader.source, planner.report, **saved_at), planner.report

    def _newest_snapshot(self) -> int | None:
        """The newest step of which every rank's snapshot is held, on its node or a peer's, unless
        the run starts afresh."""
        if self.snapshots is None or self.cfg.resume_from == "none":
            return None
        return self.snapshots.restore_step(self.group)

    def _restored(self, step: int, source: str, report: LoadReport, **saved_at: int) -> int:
        """A restore done, from any tier: said alike, with what did not match (and `saved_world_size`
        where it was saved at another size)."""
        if source in ("local-snapshot", "peer-snapshot"):
            logger.info("resumed from the snapshot of step %d (%s)", step,
                        "its own node's" if source == "local-snapshot" else "a peer node's copy")
        if report:
            logger.warning("restore of step %d (%s): %s", step, source, report.describe())
        self.events.emit("restore_end", step=step, source=source, **report.event_fields(), **saved_at)
        self._retire_newer_than(step)
        return step

    def _retire_newer_than(self, step: int) -> None:
        """Checkpoints past the resumed step belong to an abandoned run (or did not verify):
        were they kept, a later `auto` resume would jump back onto that other timeline."""
        if self.snapshots is not None:
            self.snapshots.forget_newer_than(step)
            if self.tends_local_dir:  # an elastic run's snapshots at its other sizes (ett/snapshots/reshard.py)
                reshard.forget_newer_than(self.cfg.local_dir, self.world_size, step)
        if self.tends_local_dir:  # their local copies would only be overwritten
            for folder in step_folders(self.cfg.local_dir):
                if step_of(folder) > step:
                    shutil.rmtree(folder, ignore_errors=True)
        if self.rank != 0 or not self.cfg.dir:
            return
        for folder in step_folders(self.cfg.dir):
            if step_of(folder) > step:
                logger.warning("removing checkpoint %s: newer than the resumed step %d", folder, step)
                (folder / MARKER).unlink(missing_ok=True)
                shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        self.wait()
        self.pruner.shutdown()
        if self.snapshots is not None:
            self.snapshots.close()
        self.committer.shutdown()
        self.stager.close()
        if self.mode == AsyncCheckpointerType.PROCESS:
            stop_checkpoint_process()
