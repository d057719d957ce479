"""The agent's own check of where a job may read and write checkpoints, made again at each launch
(a link laid in the job's area after it was submitted resolves elsewhere now, and the service is
not the only line of defence), and of the drills this agent allows."""

import os
from pathlib import Path

from ett.paths import inside
from ett.protocol import NODE_LOSS_FAULT
from ett.protocol.messages import LaunchCommand


def launch_refusal(command: LaunchCommand, checkpoint_root: Path | None, node_loss_drills: bool = False) -> str | None:
    """Why the launch must not run (None: it may): its checkpoint folder outside its owner's
    area or outside this agent's checkpoint root, a resume point outside its folder, or a
    `lose_node` fault on an agent that does not allow the drill (it ends every job of the node)."""
    if not node_loss_drills and any(fault.action == NODE_LOSS_FAULT for fault in command.faults):
        return (f"refused: faults: {NODE_LOSS_FAULT} ends this agent and every job on its node; it runs only on "
                "agents started with ETT_AGENT_NODE_LOSS_DRILLS=true")
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
