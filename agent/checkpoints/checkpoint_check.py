"""Whether a rank's `ckpt_committed` names a checkpoint that is there: the agent's word on it.

The service resumes a job from the newest checkpoint its events say was committed, and a rank's
events are the job's to write: one forged line would name any folder at any step. Before the
forwarder sends such an event it looks, as root and so without following a link anywhere below the
job's checkpoint folder (agent.files.beneath), for the folder inside the job's own checkpoint folder, its
commit marker with the event's step, and each file the marker lists, of the listed size. The
contents' CRC-32s are left to resume, which checks them before loading (ett/checkpoints/folders.py, verify).
"""

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from agent.files.beneath import open_folder_beneath, read_beneath
from ett.protocol import MARKER

MARKER_MAX_BYTES = 16 << 20  # a manifest lists each file once: far less in any real checkpoint


def unverified_reason(event: dict[str, Any], checkpoint_dir: str | None) -> str | None:
    """None when the event's checkpoint verifies inside `checkpoint_dir`, else why not."""
    data = event.get("data")
    path, step = (data.get("path"), event.get("step")) if isinstance(data, dict) else (None, None)
    if checkpoint_dir is None:
        return "the job has no checkpoint folder on this node"
    if not isinstance(path, str) or not isinstance(step, int):
        return "no path or step"
    relative = PurePosixPath(os.path.normpath(os.path.relpath(os.path.normpath(path), checkpoint_dir)))
    if relative.is_absolute() or ".." in relative.parts or relative == PurePosixPath("."):
        return f"{path} is not inside the job's checkpoint folder {checkpoint_dir}"
    top = Path(checkpoint_dir)
    try:
        folder = open_folder_beneath(top.parent, Path(top.name) / relative)
        try:
            return _manifest_problem(folder, step)
        finally:
            os.close(folder)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"


def _manifest_problem(folder: int, step: int) -> str | None:
    try:
        manifest = json.loads(read_beneath(folder, MARKER, MARKER_MAX_BYTES) or b"null")
    except ValueError:
        return f"unreadable {MARKER} marker"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return f"no {MARKER} marker"
    if manifest.get("step") != step:
        return f"its {MARKER} marker is of step {manifest.get('step')}, the event of step {step}"
    for name, entry in manifest["files"].items():
        problem = _file_problem(folder, PurePosixPath(name), entry)
        if problem is not None:
            return problem
    return None


def _file_problem(folder: int, name: PurePosixPath, entry: Any) -> str | None:
    if name.is_absolute() or ".." in name.parts or not isinstance(entry, dict):
        return f"its manifest names {name}"
    inner = None
    if len(name.parts) > 1:  # a file in a folder of the checkpoint's (the Hugging Face Trainer's)
        inner = open_folder_beneath(Path(f"/proc/self/fd/{folder}"), Path(*name.parts[:-1]))
    try:
        st = os.stat(name.parts[-1], dir_fd=folder if inner is None else inner, follow_symlinks=False)
    except FileNotFoundError:
        return f"missing file {name}"
    finally:
        if inner is not None:
            os.close(inner)
    if not stat.S_ISREG(st.st_mode) or st.st_size != entry.get("bytes"):
        return f"{name} is not the file of {entry.get('bytes')} bytes its manifest lists"
    return None
