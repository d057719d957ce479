"""What the agent says on a rank's events before it forwards them (docs/reliability.md, "Security").

A rank's spool is the job's to write: a line may claim any job, attempt or source, and any
checkpoint committed. The forwarder sets the job and attempt from the folder the line was found
in and the source from the file's name (`rank-R.jsonl` is `rank:R`), and checks a `ckpt_committed`
on disk (agent.checkpoints.checkpoint_check): `data.verified` says whether the service may resume from it.
The job's secrets are blanked in every string of the event's `data` (ett/protocol/redaction.py).
The agent's own spool (`node-NAME.jsonl`, in a folder no job writes) is sent as it was written.
"""

import logging
import re
from pathlib import Path
from typing import Any

from agent.checkpoints.checkpoint_check import unverified_reason
from agent.files.spool import parse_event
from agent.forwarding.launches import Launches
from ett.protocol.event_fields import CkptCommittedData

log = logging.getLogger(__name__)
# A rank's number as ett.protocol.rank_spool writes it: "rank-00.jsonl" or a digit of another script
# is not rank 0's spool, nor "rank-0.jsonl\n" (`$` would take a newline at the end: \Z does not).
RANK_SPOOL_NAME = re.compile(r"^rank-(0|[1-9][0-9]{0,8})\.jsonl\Z", re.ASCII)


class Stamper:
    def __init__(self, spool_root: Path, launches: Launches | None = None) -> None:
        self.spool_root = spool_root
        self.launches = launches or Launches(spool_root)  # the job's checkpoint folder and secrets

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
        launch = self.launches.of(f"{job_id}/{attempt}")
        if isinstance(event.get("data"), dict):
            launch.secrets.blank_data(str(event.get("kind")), event["data"])
        if event.get("kind") == "ckpt_committed":
            reason = unverified_reason(event, launch.checkpoint_dir)
            if reason is not None:
                log.warning("%s: a checkpoint commit that does not verify, not a resume point: %s", name, reason)
            data = event.get("data") if isinstance(event.get("data"), dict) else {}
            event["data"] = data | CkptCommittedData(verified=reason is None)
        return event

    def forget(self, attempt: str) -> None:
        """An attempt's spool is gone (JOB_ID/ATTEMPT)."""
        self.launches.forget(attempt)
