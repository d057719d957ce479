"""The agent's own check of where a job may read and write checkpoints, made again at each launch:
a link laid in the job's area after it was submitted resolves elsewhere now, and the service is
not the only line of defence."""

import os
from pathlib import Path

from ett.paths import inside
from ett.protocol.messages import LaunchCommand


def launch_refusal(command: LaunchCommand, checkpoint_root: Path | None) -> str | None:
    """Why the launch must not run (None: it may): its checkpoint folder outside its owner's
    area or outside this agent's checkpoint root, or a resume point outside its folder."""
    ckpt = command.checkpoint
    if ckpt.dir is None:
        return None
    if ckpt.area is not None and not inside(ckpt.dir, ckpt.area):
        return (f"refused: checkpoint.dir {ckpt.dir} resolves to {os.path.realpath(ckpt.dir)}, outside the job's "
                f"checkpoint area {ckpt.area}")
    if checkpoint_root is not None and not inside(ckpt.dir, checkpoint_root):
        return (f"refused: checkpoint.dir {ckpt.dir} resolves to {os.path.realpath(ckpt.dir)}, outside this agent's "
                f"checkpoint root {checkpoint_root} (ETT_AGENT_CHECKPOINT_ROOT)")
    if ckpt.resume_from is not None and not inside(ckpt.resume_from, ckpt.dir):
        return f"refused: checkpoint.resume_from {ckpt.resume_from} is outside the job's checkpoint.dir {ckpt.dir}"
    return None
