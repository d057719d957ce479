"""Ships each rank's output to the service, which keeps its last part for `ett logs`, the API and
the job page (docs/agent.md, "Logs").

The forwarder thread calls `ship_once` beside its event batches: what is new in every
`logs/rank-R.log` of the spool (and the rest of `rank-R.log.1` when the file was rotated since),
at most PIECE_BYTES a file a round (a rank that prints faster has its middle skipped, and the skip
counted), in one request. A position moves on only once the service took the piece, and the
positions are kept on disk, so an agent restart neither loses nor repeats a piece. An ended
attempt's spool is retired only once its logs are all shipped (`shipped`). The files are the job's:
opened without following a link, as regular files of one link, read in bounded pieces.

The job's secrets are blanked here again, across the pieces (ett/protocol/redaction.py): a rank may
write its log file itself, past its runner's blanking, a secret's start in one write and its end
seconds later. The end of what is read that may begin a secret is not shipped, and the position
stays before it, until more is written or the attempt has ended. The log of a rank beyond the
attempt's world is not read at all (its number comes from a file name the job lays).
"""

import contextlib
import json
import logging
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from agent.files.spool import AttemptPaths, open_job_file, save_private_json
from agent.forwarding.launches import Launches
from agent.forwarding.listing import Listings
from ett.protocol import LOGS_DIR
from ett.protocol.redaction import Redactor, Secrets

log = logging.getLogger(__name__)
PIECE_BYTES = 64 << 10
# A rank's number as ett.protocol.rank_log writes it: "rank-00.log" or a digit of another script is
# not rank 0's log, nor "rank-0.log\n" (`$` would take a newline at the end: \Z does not).
RANK_LOG_NAME = re.compile(r"^rank-(0|[1-9][0-9]{0,8})\.log\Z", re.ASCII)
REFUSED_PIECE = re.compile(r"\blogs\.(\d+)\.")  # a 422 names the piece it refused
Send = Callable[[list[dict[str, Any]]], httpx.Response]


class LogShipper:
    def __init__(self, spool_root: Path, state_dir: Path, send: Send, launches: Launches | None = None) -> None:
        self.spool_root, self.send = spool_root, send
        self.launches = launches or Launches(spool_root)  # each attempt's world and secrets
        self.listings = Listings()
        self._said: set[str] = set()  # attempts whose logs beyond their world were said to be set aside
        self.positions_file = state_dir / "log-positions.json"
        # JOB_ID/ATTEMPT/RANK -> [inode, offset] of what the service has
        self.positions: dict[str, list[int]] = {}
        with contextlib.suppress(OSError, ValueError):
            self.positions = json.loads(self.positions_file.read_text())

    def ship_once(self) -> bool:
        """Sends what is new; False when the service could not take it (tried again later). One
        request per attempt: a refusal (an attempt no longer this node's, a rank beyond its world)
        is that attempt's alone, never another job's output."""
        batches: dict[str, tuple[list[dict[str, Any]], dict[str, list[int]]]] = {}  # JOB_ID/ATTEMPT ->
        for path, rank in self._rank_logs():
            job_id, attempt = path.parent.parent.parent.name, path.parent.parent.name
            key = f"{job_id}/{attempt}/{rank}"
            try:
                text, skipped, position = self._new_part(path, self.positions.get(key),
                                                         self.launches.of(f"{job_id}/{attempt}").secrets)
            except OSError as exc:  # the job's file: its trouble alone
                log.debug("rank log %s not read: %s", path, exc)
                continue
            if text or skipped:
                pieces, moved = batches.setdefault(f"{job_id}/{attempt}", ([], {}))
                pieces.append({"job_id": job_id, "attempt": int(attempt), "rank": rank,
                               "text": text, "skipped": skipped})  # fmt: skip
                moved[key] = position
        shipped, taken = True, {}
        for attempt, (pieces, moved) in batches.items():
            try:
                done = self._send_attempt(attempt, pieces)
            except httpx.HTTPError as exc:
                log.warning("shipping %d rank logs failed: %s", len(pieces), exc)
                shipped = False
                break
            if not done:
                shipped = False  # kept for the next round
                continue
            taken |= moved
        if taken:
            self.positions |= taken
            self._save()
        return shipped

    def _send_attempt(self, attempt: str, pieces: list[dict[str, Any]]) -> bool:
        """Sends one attempt's pieces; False when the service could not take them now (a 5xx, a
        429: kept for later). A piece the service refuses by name (`logs.N...`: a rank the job does
        not have) is dropped and the rest sent again; any other refusal is for good, not resent."""
        while pieces:
            response = self.send(pieces)
            if response.status_code >= 500 or response.status_code == 429:
                return False
            if response.status_code == 200:
                return True
            named = {int(n) for n in REFUSED_PIECE.findall(response.text)}
            log.warning("rank logs of %s refused: %d %s", attempt, response.status_code, response.text[:200])
            if response.status_code != 422 or not named & set(range(len(pieces))):
                return True
            pieces = [piece for i, piece in enumerate(pieces) if i not in named]
        return True

    def _rank_logs(self) -> list[tuple[Path, int]]:
        """Each attempt's rank logs with their rank, but those of ranks beyond its world (said once)."""
        found = []
        for job_id in self.listings.names(self.spool_root):
            for attempt in self.listings.names(self.spool_root / job_id):
                logs = self.spool_root / job_id / attempt / LOGS_DIR
                world = self.launches.of(f"{job_id}/{attempt}").world
                beyond = 0
                for name in self.listings.names(logs):
                    match = RANK_LOG_NAME.match(name)
                    if match is None:
                        continue
                    if world is not None and int(match.group(1)) >= world:
                        beyond += 1
                        continue
                    found.append((logs / name, int(match.group(1))))
                if beyond and f"{job_id}/{attempt}" not in self._said:
                    self._said.add(f"{job_id}/{attempt}")
                    log.warning("attempt %s/%s: %d rank logs of ranks beyond its %d not shipped", job_id, attempt,
                                beyond, world)
        return found

    def _new_part(self, path: Path, known: list[int] | None, secrets: Secrets) -> tuple[str, int, list[int]]:
        """The text after the known position (the rotated-away rest first), its secrets blanked, the
        bytes skipped, and the new position: before what may begin a secret, kept back for the next
        round unless the attempt has ended."""
        fd = open_job_file(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            inode, offset = known if known is not None else (st.st_ino, 0)
            older, older_end = b"", offset
            if inode != st.st_ino:  # rotated: the rest of the older part is in rank-R.log.1
                older, older_end = self._rest_of_rotated(path, inode, offset)
                offset = 0
            skipped = max(0, st.st_size - offset - PIECE_BYTES)
            data = os.pread(fd, st.st_size - offset - skipped, offset + skipped)
        finally:
            os.close(fd)
        redactor = Redactor(secrets)
        text = redactor.feed(older + data)
        if redactor.held and AttemptPaths(path.parent.parent).ended_marker.exists():
            text += redactor.flush()  # no more will be written: its last bytes, whole
        position = [st.st_ino, offset + skipped + len(data) - redactor.held]
        if redactor.held > len(data):  # kept back from the rotated-away part: read from there again
            position = [inode, older_end - (redactor.held - len(data))]
        return text.decode(errors="replace"), skipped, position

    @staticmethod
    def _rest_of_rotated(path: Path, inode: int, offset: int) -> tuple[bytes, int]:
        """The rest of the rotated-away part after `offset` (its last PIECE_BYTES), and where it ends."""
        try:
            fd = open_job_file(path.with_name(path.name + ".1"), os.O_RDONLY)
        except OSError:
            return b"", offset
        try:
            st = os.fstat(fd)
            if st.st_ino != inode or st.st_size <= offset:
                return b"", offset
            rest = os.pread(fd, min(PIECE_BYTES, st.st_size - offset), max(offset, st.st_size - PIECE_BYTES))
            return rest, st.st_size
        finally:
            os.close(fd)

    def shipped(self, attempt_dir: Path) -> bool:
        """Whether every rank log of the attempt is with the service, to its end."""
        attempt = f"{attempt_dir.parent.name}/{attempt_dir.name}"
        world = self.launches.of(attempt).world
        for name in self.listings.names(attempt_dir / LOGS_DIR):
            match = RANK_LOG_NAME.match(name)
            if match is None or (world is not None and int(match.group(1)) >= world):
                continue  # not shipped at all (ship_once reads no other)
            try:
                st = (attempt_dir / LOGS_DIR / name).lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or not st.st_size:
                continue
            if self.positions.get(f"{attempt}/{int(match.group(1))}") != [st.st_ino, st.st_size]:
                return False
        return True

    def forget(self, attempt: str) -> None:
        """An attempt's spool is gone (JOB_ID/ATTEMPT)."""
        self.positions = {k: v for k, v in self.positions.items() if not k.startswith(f"{attempt}/")}
        self._said.discard(attempt)
        self.listings.forget(self.spool_root / attempt)
        self._save()

    def _save(self) -> None:
        save_private_json(self.positions_file, self.positions)
