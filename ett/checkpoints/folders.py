"""The on-disk contract of a checkpoint: its folder, its commit marker, and how one is chosen for resume.

A checkpoint is a folder. It is committed when it holds `COMMITTED`, a JSON manifest written
last (write-temp + fsync + rename) that lists every file of the checkpoint with its size and
CRC-32. A folder without a marker is torn (its save never finished); one whose files do not match
their manifest is corrupt. Neither is ever loaded: resume takes the newest folder that verifies
and says why it skipped each newer one.

Our own checkpoints are `<dir>/step-00000040/` (DCP's files); the Hugging Face integration marks
the Trainer's `checkpoint-40/` folders the same way.
"""

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ett.checkpoints.tiers import file_crc32, file_entry
from ett.protocol import MARKER

logger = logging.getLogger(__name__)

STEP_FOLDER = re.compile(r"^step-(\d{8})$")

Manifest = dict[str, dict[str, int]]  # file name (relative) -> {"bytes", "crc32"}
# Files whose CRC-32s verify reads at once (zlib and file reads release the GIL): a rank writes
# `checkpoint.write_threads` files, and resume waits for the whole check.
VERIFY_THREADS = 8


def step_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def step_of(folder: Path, pattern: re.Pattern = STEP_FOLDER) -> int | None:
    """The step in `folder`'s name: the pattern's group `step`, else its first group; None: no match."""
    match = pattern.match(folder.name)
    if not match:
        return None
    step = match.group("step") if "step" in pattern.groupindex else match.group(1)
    # A user's group may take what is no number ('checkpoint-(.+)' and a 'checkpoint-final'): no step.
    return int(step) if step and step.isascii() and step.isdigit() else None


def step_folders(root: str | Path, pattern: re.Pattern = STEP_FOLDER) -> list[Path]:
    """Checkpoint folders under root whose names match `pattern`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (p for p in root.iterdir() if p.is_dir() and step_of(p, pattern) is not None)
    return sorted(found, key=lambda p: step_of(p, pattern), reverse=True)


def fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def folder_manifest(folder: Path) -> Manifest:
    """Every file under `folder` but the marker (a checkpoint another library wrote)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MARKER, f"{MARKER}.tmp"))
    return {str(p.relative_to(folder)): file_entry(p) for p in files}


def write_marker(folder: Path, step: int, world_size: int, files: Manifest, **notes: Any) -> int:
    """Commit a checkpoint whose files are all durable in `folder`; returns its size in bytes.
    `notes`: more of the manifest, each one left out when empty."""
    manifest = {"step": step, "world_size": world_size, "files": files} | {k: v for k, v in notes.items() if v}
    fsync_folder(folder)  # the files' directory entries are durable before the marker
    tmp = folder / f"{MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)
    fsync_folder(folder)
    return sum(entry["bytes"] for entry in files.values())


def read_manifest(folder: Path) -> dict:
    return json.loads((folder / MARKER).read_text())


def verify(folder: Path) -> str | None:
    """None if the checkpoint is committed and intact, else why it must not be loaded."""
    if not folder.is_dir():
        return "no such folder"
    try:
        manifest = read_manifest(folder)
    except FileNotFoundError:
        return f"no {MARKER} marker (torn: its save never completed)"
    except ValueError as error:
        return f"unreadable {MARKER} marker: {error}"
    files = manifest["files"]
    for name, expected in files.items():  # the cheap checks first, all of them
        path = folder / name
        if not path.is_file():
            return f"missing file {name}"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
    pool = ThreadPoolExecutor(max_workers=VERIFY_THREADS, thread_name_prefix="ett-verify")
    try:
        for (name, expected), crc in zip(files.items(), pool.map(file_crc32, (folder / name for name in files))):
            if crc != expected["crc32"]:
                return f"{name} fails its CRC-32 check"
    finally:
        pool.shutdown(cancel_futures=True)
    return None


def first_verified(candidates: Iterable[Path]) -> Path | None:
    """The first candidate that verifies; each one skipped is logged with its reason."""
    skipped = 0
    for folder in candidates:
        reason = verify(folder)
        if reason is None:
            if skipped:
                logger.warning("resuming from %s, the newest checkpoint that verifies", folder)
            return folder
        logger.warning("skipping checkpoint %s: %s", folder, reason)
        skipped += 1
    if skipped:
        logger.warning("no checkpoint verifies; starting from step 0")
    return None


def resume_candidates(root: str | Path | None, resume_from: str | Path | None,
                      pattern: re.Pattern = STEP_FOLDER) -> list[Path]:
    """Newest first: the named checkpoint (when given) and those older than it beside it, or
    every checkpoint under `root`."""
    if resume_from:
        chosen = Path(resume_from)
        chosen_step = step_of(chosen, pattern) or 0
        return [chosen, *(p for p in step_folders(chosen.parent, pattern) if step_of(p, pattern) < chosen_step)]
    return step_folders(root, pattern) if root else []


def prune(root: str | Path, keep: int, pattern: re.Pattern = STEP_FOLDER) -> None:
    """Keeps the newest `keep` committed checkpoints under root; older committed ones, and torn
    ones older than the newest commit, are removed, their marker first: a folder half removed is
    never taken for a committed one."""
    committed = [p for p in step_folders(root, pattern) if (p / MARKER).exists()]
    if not committed:
        return
    newest = step_of(committed[0], pattern)
    for folder in step_folders(root, pattern):
        if folder in committed[keep:] or (folder not in committed and step_of(folder, pattern) < newest):
            (folder / MARKER).unlink(missing_ok=True)
            shutil.rmtree(folder, ignore_errors=True)
