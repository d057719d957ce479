"""Rank logs over HTTP: what an agent ships, what a user reads."""

from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints

# An agent ships at most 64 KiB of a rank's output a round (agent/forwarding/log_shipper.py); decoded, a
# byte may take up to 4 characters' room in the worst case of replacement characters.
PIECE_MAX_CHARS = 256 << 10


class LogPiece(BaseModel):
    job_id: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    attempt: int = Field(ge=0)
    rank: int = Field(ge=0)
    text: Annotated[str, StringConstraints(max_length=PIECE_MAX_CHARS)]
    skipped: int = Field(0, ge=0)


class AgentLogBatch(BaseModel):
    logs: list[LogPiece] = Field(max_length=4096)


class RankLogOut(BaseModel):
    job_id: str
    attempt: int
    rank: int
    node: str | None = Field(description="the node the rank ran on; null when it has printed nothing yet")
    text: str
    start: int = Field(description="where `text` begins in the rank's output (characters)")
    end: int = Field(description="where it ends: pass it as `since` to read what follows")
    ranks: list[int] = Field(description="the attempt's ranks that have output")
