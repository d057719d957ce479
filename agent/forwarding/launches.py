"""What the forwarder knows of an attempt's launch (agent.forwarding.forward): its number of ranks
(a spool or log of a rank beyond it is set aside unsent: its number comes from a file name the job
lays), its checkpoint folder (agent.forwarding.stamp), and its secrets, the values of its `env`,
blanked in its ranks' output and event strings before they are shipped (ett/protocol/redaction.py).

The agent says it at launch (`know`, from the monitor thread; the forwarder thread only reads).
The secrets live in memory only (the launch file beside the spool leaves `env` out): after an agent
restart an attempt's world and folder come from that file, its secrets are not known on the node,
and the service blanks what it stores.
"""

from dataclasses import dataclass
from pathlib import Path

from agent.files.spool import AttemptPaths
from ett.protocol.messages import LaunchCommand
from ett.protocol.redaction import Secrets


@dataclass(frozen=True)
class Launch:
    world: int | None  # None: not known (no readable launch file): nothing is set aside for it
    checkpoint_dir: str | None
    secrets: Secrets


UNKNOWN = Launch(None, None, Secrets(()))


class Launches:
    def __init__(self, spool_root: Path) -> None:
        self.spool_root = spool_root
        self._known: dict[str, Launch] = {}  # JOB_ID/ATTEMPT ->

    def know(self, command: LaunchCommand) -> None:
        """The agent was given this launch (before its ranks write anything)."""
        self._known[f"{command.job_id}/{command.attempt}"] = Launch(
            command.nnodes * command.nproc_per_node, command.checkpoint.dir, Secrets(command.env.values()))

    def of(self, attempt: str) -> Launch:
        """JOB_ID/ATTEMPT's launch, as the agent said it or as the launch file beside its spool says."""
        known = self._known.get(attempt)
        if known is not None:
            return known
        try:  # the agent's file (root's folder), written before the ranks start; read again until it is there
            launch = LaunchCommand.model_validate_json(AttemptPaths(self.spool_root / attempt).launch_file.read_bytes())
        except (OSError, ValueError):
            return UNKNOWN
        known = self._known[attempt] = Launch(launch.nnodes * launch.nproc_per_node, launch.checkpoint.dir, Secrets(()))
        return known

    def forget(self, attempt: str) -> None:
        """An attempt's spool is gone (JOB_ID/ATTEMPT)."""
        self._known.pop(attempt, None)
