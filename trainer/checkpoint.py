"""Asynchronous DCP checkpoints with an atomic commit marker, retention and verified resume.

Layout: `<dir>/step-00000040/` holds DCP's shard files (`__<rank>_<i>.distcp`), its `.metadata`
and, written last, `COMMITTED`: a JSON manifest (step, world size, size and CRC-32 of every file
of the checkpoint). A folder without a marker whose manifest verifies is torn or corrupt: resume
skips it with a warning and never loads it.

Saving copies the state to CPU memory (staging, trainer/checkpoint_staging.py): model buffers,
RNG states, data position and step at once; parameters and optimizer state in a background
thread, overlapped with the next step's forward and backward, which the loop waits for with
`wait_for_staging()` before `optimizer.step`. DCP then writes in the background. When the write
finishes on every rank (DCP's coordinator writes `.metadata`
after gathering every rank's write result, and every file is fsynced), rank 0 writes the marker
with write-temp + fsync + rename and prunes old checkpoints.

With `local_dir` (node-local fast disk), DCP writes there first and the ranks then copy the files
to `dir` in the background before the marker is written (trainer/checkpoint_tiers.py); `dir`
stays the checkpoint of record, and resume reads the local copies that match its manifest.
"""

import json
import logging
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, _async_process_executor
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainer.checkpoint_staging import ReusedBufferStager
from trainer.checkpoint_tiers import TieredReader, copy_to_persistent, file_crc32
from trainer.errors import ConfigError
from trainer.events import EventWriter

logger = logging.getLogger(__name__)

MARKER = "COMMITTED"
STEP_FOLDER = re.compile(r"^step-(\d{8})$")


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: no checkpoints are saved
    # Node-local fast folder: saves land here first and are copied to `dir` in the background;
    # resume reads the files here that match the checkpoint's manifest. Empty: `dir` only.
    local_dir: str = ""
    interval_steps: int = 0  # save every N steps; 0: only at the last step (and on SIGTERM)
    keep: int = 3  # newest committed checkpoints kept
    resume_from: str = "auto"  # "auto": newest in dir that verifies | "none" | a step folder
    async_mode: str = "process"  # "process" | "thread": where DCP writes in the background

    def validate(self) -> None:
        if self.interval_steps < 0:
            raise ValueError(f"checkpoint.interval_steps must be >= 0, got {self.interval_steps}")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {self.keep}")
        if self.resume_from not in ("auto", "none") and step_of(Path(self.resume_from)) is None:
            raise ValueError(f"checkpoint.resume_from must be auto, none or a step-NNNNNNNN folder, got {self.resume_from!r}")
        if self.async_mode not in ("process", "thread"):
            raise ValueError(f"checkpoint.async_mode must be 'process' or 'thread', got {self.async_mode!r}")
        if self.local_dir and (not self.dir or Path(self.local_dir).resolve() == Path(self.dir).resolve()):
            raise ValueError("checkpoint.local_dir needs checkpoint.dir, and another folder: the local copy caches it")


def step_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def step_of(folder: Path) -> int | None:
    match = STEP_FOLDER.match(folder.name)
    return int(match.group(1)) if match else None


def step_folders(root: str | Path) -> list[Path]:
    """Checkpoint folders under root, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of, reverse=True)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(folder: Path, step: int, world_size: int, files: dict[str, dict[str, int]] | None = None) -> int:
    """Commit a checkpoint whose files are all durable in `folder`; returns its size in bytes.
    `files`: the manifest entries when known (copied from the local tier), else read here."""
    if files is None:
        metadata = FileSystemReader(folder).read_metadata()
        names = sorted({".metadata"} | {item.relative_path for item in metadata.storage_data.values()})
        files = {name: {"bytes": (folder / name).stat().st_size, "crc32": file_crc32(folder / name)} for name in names}
    manifest = {"step": step, "world_size": world_size, "files": files}
    _fsync_folder(folder)  # the shard files' directory entries are durable before the marker
    tmp = folder / f"{MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)
    _fsync_folder(folder)
    return sum(entry["bytes"] for entry in files.values())


def verify(folder: Path) -> str | None:
    """None if the checkpoint is committed and intact, else why it must not be loaded."""
    if not folder.is_dir():
        return "no such folder"
    try:
        manifest = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER} marker (torn: its save never completed)"
    except ValueError as error:
        return f"unreadable {MARKER} marker: {error}"
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"missing file {name}"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if file_crc32(path) != expected["crc32"]:
            return f"{name} fails its CRC-32 check"
    return None


def find_resume_folder(cfg: CheckpointConfig) -> Path | None:
    """The newest committed checkpoint that verifies: from `dir` ("auto"), or the given folder,
    falling back to older ones beside it. Each one skipped is logged with its reason."""
    if cfg.resume_from == "none":
        return None
    if cfg.resume_from == "auto":
        candidates = step_folders(cfg.dir) if cfg.dir else []
    else:
        chosen = Path(cfg.resume_from)
        older = [p for p in step_folders(chosen.parent) if step_of(p) < step_of(chosen)]
        candidates = [chosen, *older]
    for folder in candidates:
        reason = verify(folder)
        if reason is None:
            return folder
        logger.warning("skipping checkpoint %s: %s", folder, reason)
    if candidates:
        logger.warning("no checkpoint verifies; starting from step 0")
    return None


class ModelOptimizerState(Stateful):
    """Model and optimizer as DCP sees them: sharded (DTensor) state dicts, saved and loaded in place."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def changed_only_by_optimizer_step(self) -> list[torch.Tensor]:
        """Parameters and optimizer state: the tensors a save may copy until the next optimizer.step."""
        optimizer_state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*self.model.parameters(), *optimizer_state]


class RNGState(Stateful):
    """Each rank's generators, under a key of its own (DCP would keep one copy of equal keys)."""

    def __init__(self, rank: int):
        self.key = f"rank{rank}"

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state[self.key]["cpu"])
        if "cuda" in state[self.key]:
            torch.cuda.set_rng_state(state[self.key]["cuda"])


class TrainProgress(Stateful):
    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, events: EventWriter, model: nn.Module):
        self.cfg, self.events = cfg, events
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # One rank per node looks after the node's local folder (retention, abandoned steps).
        self.tends_local_dir = bool(cfg.local_dir) and int(os.environ.get("LOCAL_RANK", "0")) == 0
        # DCP's own collectives run in a background thread (or process): they get a group of
        # their own, so they never interleave with the training loop's on the default group.
        self.group = dist.new_group(backend="gloo")
        self.mode = self._agree_on_mode(model)
        # Staging buffers allocated by the first save and reused; parameters and optimizer state
        # are copied in the background until wait_for_staging().
        self.stager = ReusedBufferStager(
            share_memory=self.mode == AsyncCheckpointerType.PROCESS, pin_memory=torch.cuda.is_available()
        )
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ett-ckpt-commit")
        self.in_flight: Future | None = None  # the last save, until committed (or failed)

    def _agree_on_mode(self, model: nn.Module) -> AsyncCheckpointerType:
        """Process-based saving keeps serialisation and file writes off the training process's
        GIL. It stages into shared memory, which containers often cap (Docker: 64 MiB of
        /dev/shm); where this rank's state (weights + 2 Adam moments) does not fit, fall back to
        thread-based saving. All ranks must agree: the checkpoint processes form one group."""
        if self.cfg.async_mode != "process":
            return AsyncCheckpointerType.THREAD
        local_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())
        shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        fits = int(shm_free > 4 * local_bytes)
        if not fits:
            logger.warning("checkpoint.async_mode: /dev/shm has %d MiB free, too little for process-based "
                           "saving of %d MiB of state; saving from a thread instead", shm_free >> 20, 3 * local_bytes >> 20)
        agreed = torch.tensor([fits])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return AsyncCheckpointerType.PROCESS if agreed.item() else AsyncCheckpointerType.THREAD

    def due(self, step: int, last_step: int) -> bool:
        interval = self.cfg.interval_steps
        return bool(self.cfg.dir) and (step == last_step or (interval > 0 and step % interval == 0))

    def save(self, step: int, state: dict) -> None:
        """Blocks for the copy of everything but the parameters and optimizer state, whose copy
        goes on until wait_for_staging(); the write and the commit follow in the background."""
        self.events.emit("ckpt_start", step=step)
        self.wait()  # the stager reuses its CPU buffers: the previous save must be written first
        self.stager.copy_in_background(
            t for s in state.values() if isinstance(s, ModelOptimizerState) for t in s.changed_only_by_optimizer_step()
        )
        folder = step_folder(self.cfg.dir, step)
        if self.rank == 0:  # a folder left by an abandoned run is rewritten: uncommit it first
            folder.mkdir(parents=True, exist_ok=True)
            (folder / MARKER).unlink(missing_ok=True)
        # With a local tier, DCP writes to node-local disk without fsync: the copy to `folder` is the durable one.
        target = step_folder(self.cfg.local_dir, step) if self.cfg.local_dir else folder
        try:
            response = dcp.async_save(
                state, storage_writer=FileSystemWriter(target, sync_files=not self.cfg.local_dir, overwrite=True),
                process_group=self.group,
                async_checkpointer_type=self.mode, async_stager=self.stager,
            )
        except Exception as error:
            logger.exception("checkpoint of step %d failed while staging", step)
            self.events.emit("ckpt_failed", step=step, error=repr(error))
            return
        # The training loop goes on from here (DESIGN: ckpt_staged ends a save's blocking part);
        # the background copy is done by its next optimizer.step.
        self.events.emit("ckpt_staged", step=step)
        self.in_flight = self.committer.submit(self._commit, response.upload_completion, step, folder)

    def wait_for_staging(self) -> None:
        """Block until the last save's copy of the state is done: call it before anything
        changes parameters or optimizer state (optimizer.step, a load)."""
        self.stager.wait_for_copies()

    def _commit(self, upload: Future, step: int, folder: Path) -> None:
        try:
            # A failed background copy fails the upload too, which raises below (on every rank with
            # a local tier: copy_to_persistent's collective is reached all the same): no commit.
            if self.cfg.local_dir:
                files = copy_to_persistent(upload, step_folder(self.cfg.local_dir, step), folder, self.group)
                if self.tends_local_dir:
                    self._prune_local()
            else:
                upload.result()
                files = None  # rank 0 reads the manifest's sizes and CRC-32s from the written files
            if self.rank == 0:
                nbytes = write_marker(folder, step, self.world_size, files)
                self.events.emit("ckpt_committed", step=step, path=str(folder), bytes=nbytes)
                logger.info("checkpoint %s committed (%.1f MiB)", folder, nbytes / 2**20)
                self._prune()
        except Exception as error:
            logger.exception("checkpoint of step %d failed", step)
            self.events.emit("ckpt_failed", step=step, error=repr(error))

    def _prune_local(self) -> None:
        """The node's local folder keeps the newest `keep` saves: enough to resume from any
        checkpoint the persistent folder keeps."""
        for old in step_folders(self.cfg.local_dir)[self.cfg.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def _prune(self) -> None:
        """Keep the newest `keep` committed checkpoints; older torn ones go too."""
        committed = [p for p in step_folders(self.cfg.dir) if (p / MARKER).exists()]
        newest = step_of(committed[0])
        for folder in step_folders(self.cfg.dir):
            if folder in committed[self.cfg.keep :] or (folder not in committed and step_of(folder) < newest):
                (folder / MARKER).unlink(missing_ok=True)
                shutil.rmtree(folder, ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight is committed (or has failed)."""
        if self.in_flight is not None:
            self.in_flight.result()
            self.in_flight = None

    def restore(self, state: dict) -> int:
        """Load the checkpoint to resume from into `state`; returns its step (0: none)."""
        self.wait_for_staging()
        chosen = [None]
        if self.rank == 0:
            folder = find_resume_folder(self.cfg)
            chosen = [str(folder) if folder else None]
        dist.broadcast_object_list(chosen, src=0, group=self.group)
        if chosen[0] is None:
            self._retire_newer_than(0)
            return 0
        folder = Path(chosen[0])
        manifest = json.loads((folder / MARKER).read_text())
        if manifest["world_size"] != self.world_size:
            raise ConfigError(f"checkpoint.resume_from: {folder} was written by {manifest['world_size']} ranks, "
                              f"this run has {self.world_size}; the data position and RNG states are per rank")
        self.events.emit("restore_start")
        local = step_folder(self.cfg.local_dir, step_of(folder)) if self.cfg.local_dir else None
        reader = TieredReader(folder, local, manifest["files"])
        dcp.load(state, storage_reader=reader, process_group=self.group)
        step = state["progress"].step
        logger.info("resumed from %s: %s (local %d bytes, persistent %d bytes)", folder, reader.source,
                    reader.bytes_read["local"], reader.bytes_read["persistent"])
        self.events.emit("restore_end", step=step, source=reader.source)
        self._retire_newer_than(step)
        return step

    def _retire_newer_than(self, step: int) -> None:
        """Checkpoints past the resumed step belong to an abandoned run (or did not verify):
        were they kept, a later `auto` resume would jump back onto that other timeline."""
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
        self.committer.shutdown()
        self.stager.close()
        daemon = _async_process_executor._CHECKPOINT_PROCESS
        if daemon is not None:
            # DCP has no public call to stop its checkpoint process. Ask it to exit, without the
            # handle's __del__, which would wait 5 s for it; left alone it dies on EOF with a traceback.
            daemon._send(_async_process_executor._CheckpointSaveProcessControlOpts.TERMINATE)
