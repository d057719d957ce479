"""Bearer tokens: random secrets shown once, stored only as SHA-256 digests."""

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Role, Token
from service.outcomes import Unauthorized

TOKEN_PREFIX = "ett_"


def hash_token(secret: str) -> str:
    # The secrets are 256-bit random values, so a fast hash is enough (no password stretching).
    return hashlib.sha256(secret.encode()).hexdigest()


def unauthorized() -> Unauthorized:
    return Unauthorized("a valid bearer token is required (create one with `ett token create`)")


def create_token(
    session: Session, role: Role, subject: str, expires_at: datetime | None = None, job_id: str | None = None
) -> str:
    """Stores a new token and returns its secret, which is never stored nor shown again. `job_id`:
    an agent token whose nodes serve that job only (a Slurm allocation's)."""
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(Token(subject=subject, role=role, token_hash=hash_token(secret), expires_at=expires_at, job_id=job_id))
    return secret


def expired(expires_at: datetime | None) -> bool:
    return expires_at is not None and expires_at <= datetime.now(UTC)


def find_token(session: Session, secret: str) -> Token | None:
    digest = hash_token(secret)
    token = session.scalar(select(Token).where(Token.token_hash == digest))
    # The lookup is by digest; the constant-time compare keeps the final check free of timing leaks.
    if token is None or token.revoked or expired(token.expires_at) or not hmac.compare_digest(token.token_hash, digest):
        return None
    return token


def all_tokens(session: Session) -> Sequence[Token]:
    return session.scalars(select(Token).order_by(Token.id)).all()


def revoke_tokens(session: Session, ids: list[int]) -> list[int]:
    """Revokes the tokens with these ids; the ids that name no token."""
    found = session.scalars(select(Token).where(Token.id.in_(ids))).all()
    for token in found:
        token.revoked = True
    return sorted(set(ids) - {token.id for token in found})


@dataclass(frozen=True)
class Caller:
    """What a token says of its holder: facts fixed when the token is created (revocation is not one)."""

    token_id: int
    role: Role
    subject: str
    expires_at: datetime | None = None


class CallerCache:
    """The callers of valid tokens seen by this process, by digest, so that an agent's heartbeats
    and event batches skip the token lookup (one query and one worker-thread hop each).

    Only facts that never change are kept (an expiry among them: `get` forgets an expired entry),
    so an entry never goes stale; revocation is checked by
    the endpoints that use the cache, in their own query (service.api.deps.own_node), so a
    revoked token is refused from its next request on, as without the cache. Keyed by digest,
    like the token table: looking up a digest leaks nothing usable about the secret.
    """

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._callers: dict[str, Caller] = {}

    def get(self, digest: str) -> Caller | None:
        caller = self._callers.get(digest)
        if caller is not None and expired(caller.expires_at):  # the lookup then refuses it
            del self._callers[digest]
            return None
        return caller

    def put(self, digest: str, caller: Caller) -> None:
        if len(self._callers) >= self.max_entries:
            self._callers.clear()  # a fleet far larger than this is not expected: simply start over
        self._callers[digest] = caller
