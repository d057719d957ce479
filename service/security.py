"""Bearer tokens: random secrets shown once, stored only as SHA-256 digests."""

import hashlib
import hmac
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Role, Token

TOKEN_PREFIX = "ett_"


def hash_token(secret: str) -> str:
    # The secrets are 256-bit random values, so a fast hash is enough (no password stretching).
    return hashlib.sha256(secret.encode()).hexdigest()


def create_token(session: Session, role: Role, subject: str) -> str:
    """Stores a new token and returns its secret, which is never stored nor shown again."""
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(Token(subject=subject, role=role, token_hash=hash_token(secret)))
    return secret


def find_token(session: Session, secret: str) -> Token | None:
    digest = hash_token(secret)
    token = session.scalar(select(Token).where(Token.token_hash == digest))
    # The lookup is by digest; the constant-time compare keeps the final check free of timing leaks.
    if token is None or token.revoked or not hmac.compare_digest(token.token_hash, digest):
        return None
    return token
