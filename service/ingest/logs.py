"""The ranks' output as their agents ship it: kept per rank and attempt, its last LOG_KEEP_CHARS
characters (docs/architecture.md, "Logs"), the values of the job's `env` blanked before it is stored
(a secret printed by a job is never served back: blanked on the node already, across the pieces it
ships, and here again within each piece, ett/protocol/redaction.py), and read by the job's owner
through the API, `ett logs` and the job page."""

import re
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from ett.protocol.redaction import redact
from service.models import Attempt, AttemptNode, Job, Node, RankLog
from service.outcomes import Forbidden, NotFound, Unprocessable

LOG_KEEP_CHARS = 256 << 10
FAILED_RANK = re.compile(r"\brank (\d+)\b")


@dataclass(frozen=True)
class Piece:
    job_id: str
    attempt: int
    rank: int
    text: str
    skipped: int  # bytes the agent left out before this text (a rank printing faster than it ships)


def store_pieces(session: Session, node: Node, pieces: Sequence[Piece]) -> None:
    """Appends each piece to its rank's log; Forbidden when an attempt was not given to this node,
    Unprocessable for a rank its job does not have (a rank's number comes from a file name the job
    can lay): nothing of the batch is then stored."""
    attempts = {(p.job_id, p.attempt) for p in pieces}
    given = set(map(tuple, session.execute(
        select(Attempt.job_id, Attempt.number).join(AttemptNode)
        .where(AttemptNode.node_id == node.id, Attempt.job_id.in_({job for job, _ in attempts}))
    )))  # fmt: skip
    for job_id, attempt in attempts - given:
        raise Forbidden(f"attempt {attempt} of job {job_id} was not given to agent {node.name}")
    jobs = {job.id: job for job in session.scalars(select(Job).where(Job.id.in_({job for job, _ in attempts})))}
    for i, piece in enumerate(pieces):
        world = jobs[piece.job_id].spec.world_size
        if piece.rank >= world:
            raise Unprocessable(f"logs.{i}.rank", f"rank {piece.rank} does not exist in job {piece.job_id}: its "
                                f"ranks are 0 to {world - 1} ({world} ranks: nodes x procs_per_node)")
    rows = {(r.job_id, r.attempt, r.rank): r for r in session.scalars(
        select(RankLog).where(RankLog.job_id.in_(list(jobs))).with_for_update())}  # fmt: skip
    for piece in pieces:
        key = (piece.job_id, piece.attempt, piece.rank)
        row = rows.get(key)
        if row is None:
            row = rows[key] = RankLog(job_id=piece.job_id, attempt=piece.attempt, rank=piece.rank, text="", end=0)
            session.add(row)
        text = redact(piece.text, jobs[piece.job_id].spec.env.values())
        if piece.skipped:
            text = f"[... {piece.skipped} bytes not shipped ...]\n{text}"
        row.node, row.end = node.name, row.end + len(text)
        row.text = (row.text + text)[-LOG_KEEP_CHARS:]


@dataclass(frozen=True)
class RankLogView:
    attempt: int
    rank: int
    node: str | None
    text: str
    start: int  # where `text` begins in the rank's whole output (characters)
    end: int
    ranks: list[int]  # the ranks of the attempt that have output


def read_log(session: Session, job: Job, attempt: int | None, rank: int | None, since: int | None,
             tail: int | None) -> RankLogView:
    """A rank's log: by default the newest attempt's, and its failed rank's (else rank 0's);
    from `since` (a position `end` gave before) when still kept, else its last `tail` lines."""
    if not job.attempts:
        raise NotFound(f"job {job.id} has not started: no logs yet")
    chosen = job.attempts[-1] if attempt is None else next((a for a in job.attempts if a.number == attempt), None)
    if chosen is None:
        raise NotFound(f"job {job.id} has no attempt {attempt}")
    if rank is None:
        rank = failed_rank(chosen) or 0
    rows = {r.rank: r for r in session.scalars(
        select(RankLog).where(RankLog.job_id == job.id, RankLog.attempt == chosen.number))}  # fmt: skip
    row = rows.get(rank)
    if row is None:
        return RankLogView(chosen.number, rank, None, "", 0, 0, sorted(rows))
    start = row.end - len(row.text)
    text = row.text
    if since is not None and since >= start:
        text = row.text[since - start:]
    elif tail is not None:
        text = "".join(row.text.splitlines(keepends=True)[-tail:])
    return RankLogView(chosen.number, rank, row.node, text, row.end - len(text), row.end, sorted(rows))


def failed_rank(attempt: Attempt) -> int | None:
    """The rank a failed attempt's detail names ("rank 1 exit code 1"), if any."""
    return rank_named(attempt.detail or "") if attempt.cause else None


def rank_named(detail: str) -> int | None:
    found = FAILED_RANK.search(detail)
    return int(found.group(1)) if found else None


def failure_tails(session: Session, job: Job, lines: int = 20) -> dict[int, tuple[int, str]]:
    """Per failed attempt, the rank its failure names and that rank's last `lines` lines (for the
    job page: the traceback beside the failure)."""
    failed = {a.number: rank for a in job.attempts if (rank := failed_rank(a)) is not None}
    if not failed:
        return {}
    rows = session.scalars(select(RankLog).where(RankLog.job_id == job.id, RankLog.attempt.in_(list(failed))))
    return {row.attempt: (row.rank, "".join(row.text.splitlines(keepends=True)[-lines:]))
            for row in rows if failed[row.attempt] == row.rank}
