"""What the agent says on a rank's events before it forwards them (docs/reliability.md, "Security").

A rank's spool is the job's to write: a line may claim any job, attempt or source, and any
checkpoint committed. The forwarder sets the job and attempt from the folder the line was found
in and the source from the file's name (`rank-R.jsonl` is `rank:R`), and checks a `ckpt_committed`
on disk (agent.checkpoints.checkpoint_check): `data.verified` says whether the service may resume from it.
The agent's own spool (`node-NAME.jsonl`, in a folder no job writes) is sent as it was written.
"""

import logging
import re
from pathlib import Path
from typing import Any

from agent.checkpoints.checkpoint_check import unverified_reason
from agent.files.spool import AttemptPaths, parse_event
from ett.protocol.event_fields import CkptCommittedData
from ett.protocol.messages import LaunchCommand

log = logging.getLogger(__name__)
RANK_SPOOL_NAME = re.compile(r"^rank-(\d+)\.jsonl$")


class Stamper:
    def __init__(self, spool_root: Path) -> None:
        self.spool_root = spool_root
        self._checkpoint_dirs: dict[str, str | None] = {}  # JOB_ID/ATTEMPT -> the job's checkpoint folder

    def stamped(self, name: str, raw: bytes) -> dict[str, Any] | None:
        """The event on a line of the spool `name` (JOB_ID/ATTEMPT/events/rank-R.jsonl, or the
        agent's JOB_ID/ATTEMPT/node-NAME.jsonl), with what only the agent may say."""
        event = parse_event(raw)
        parts = name.split("/")
        if event is None or len(parts) != 4:  # the agent's own events: as it wrote them
            return event
        job_id, attempt, _, file_name = parts
        match = RANK_SPOOL_NAME.match(file_name)
        assert match is not None  # the forwarder reads no other
        event |= {"job_id": job_id, "attempt": int(attempt), "source": f"rank:{int(match.group(1))}"}
        if event.get("kind") == "ckpt_committed":
            reason = unverified_reason(event, self._checkpoint_dir(f"{job_id}/{attempt}"))
            if reason is not None:
                log.warning("%s: a checkpoint commit that does not verify, not a resume point: %s", name, reason)
            data = event.get("data") if isinstance(event.get("data"), dict) else {}
            event["data"] = data | CkptCommittedData(verified=reason is None)
        return event

    def forget(self, attempt: str) -> None:
        """An attempt's spool is gone (JOB_ID/ATTEMPT)."""
        self._checkpoint_dirs.pop(attempt, None)

    def _checkpoint_dir(self, attempt: str) -> str | None:
        """The job's checkpoint folder, as the launch command the agent wrote beside the spool said."""
        if attempt not in self._checkpoint_dirs:
            try:
                launch_file = AttemptPaths(self.spool_root / attempt).launch_file
                launch = LaunchCommand.model_validate_json(launch_file.read_bytes())
                self._checkpoint_dirs[attempt] = launch.checkpoint.dir
            except (OSError, ValueError):
                self._checkpoint_dirs[attempt] = None
        return self._checkpoint_dirs[attempt]
