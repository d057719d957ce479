"""Request limits, answered before anything parses a request: the body's size, and a
token-bucket rate limit per bearer token (per client address for requests without one).

Per token rather than per address: a fleet's agents may all reach the service through one
proxy or NAT, and each must get its own allowance. An agent needs well under one request a
second (a heartbeat every few seconds, an event batch at most every `batch_max_age_seconds`,
an extra heartbeat on each change), so the default of 50 a second in bursts of 200 leaves it
a wide margin while a runaway client gets 429 with Retry-After. The buckets live in each
service process: with several processes the limit applies per process.
"""

import hashlib
import math
import time

from fastapi import status
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Buckets idle this long are full again, so they are forgotten (memory stays bounded by the
# number of clients seen in the last minute or so).
FORGET_AFTER_SECONDS = 60.0


class RateLimit:
    def __init__(self, app: ASGIApp, per_second: float, burst: int) -> None:
        self.app, self.per_second, self.burst = app, per_second, burst
        self.buckets: dict[bytes, tuple[float, float]] = {}  # key -> (tokens, updated at)
        self.next_sweep = time.monotonic() + FORGET_AFTER_SECONDS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.per_second <= 0:
            return await self.app(scope, receive, send)
        wait = self.take(self.key(scope), time.monotonic())
        if wait is None:
            return await self.app(scope, receive, send)
        retry_after = max(1, math.ceil(wait))
        detail = f"rate limit of {self.per_second:g} requests a second (bursts of {self.burst}) exceeded; " \
                 f"retry after {retry_after} s"  # fmt: skip
        response = JSONResponse({"detail": detail}, status.HTTP_429_TOO_MANY_REQUESTS,
                                headers={"Retry-After": str(retry_after)})  # fmt: skip
        await response(scope, receive, send)

    @staticmethod
    def key(scope: Scope) -> bytes:
        authorization = dict(scope["headers"]).get(b"authorization")
        if authorization:
            # A digest, so no secret is kept in memory longer than the request.
            return b"t" + hashlib.blake2b(authorization, digest_size=16).digest()
        client = scope.get("client")
        return b"a" + (client[0] if client else "unknown").encode()

    def take(self, key: bytes, now: float) -> float | None:
        """Takes one token from the key's bucket: None if there was one, else seconds to wait."""
        if now >= self.next_sweep:
            idle = now - FORGET_AFTER_SECONDS
            self.buckets = {k: v for k, v in self.buckets.items() if v[1] > idle}
            self.next_sweep = now + FORGET_AFTER_SECONDS
        tokens, updated = self.buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - updated) * self.per_second)
        if tokens < 1.0:
            self.buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.per_second
        self.buckets[key] = (tokens - 1.0, now)
        return None


class BodySizeLimit:
    """Answers 413 to bodies over the limit, declared or streamed, before anything parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        seen, rejected = 0, False

        async def counting_receive() -> Message:
            nonlocal seen, rejected
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes and not rejected:
                # Answer now and tell the app the client left, so it stops reading and its reply is dropped.
                rejected = True
                await self._too_large(scope, receive, send)
            return {"type": "http.disconnect"} if rejected else message

        async def guarded_send(message: Message) -> None:
            if not rejected:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"request body over the limit of {self.max_bytes} bytes"
        await JSONResponse({"detail": detail}, status.HTTP_413_CONTENT_TOO_LARGE)(scope, receive, send)
