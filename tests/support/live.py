"""A real service on loopback: uvicorn in a thread serving create_app, for tests and benchmarks."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI

from service.context import ServiceContext, context_of
from service.main import KEEP_ALIVE_SECONDS, create_app
from service.models import Role
from service.security import create_token
from service.settings import Settings
from tests.support.postgres import free_port


@dataclass
class LiveService:
    url: str
    app: FastAPI

    @property
    def context(self) -> ServiceContext:
        return context_of(self.app)

    def token(self, role: str, subject: str | None = None) -> str:
        with self.context.sessions() as session:
            secret = create_token(session, Role(role), subject or role)
            session.commit()
        return secret

    def client(self, token: str | None = None, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kwargs)


@contextmanager
def live_service(settings: Settings) -> Iterator[LiveService]:
    """Serves a fresh app for the block; the database must already be at head."""
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                          timeout_keep_alive=KEEP_ALIVE_SECONDS))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test service did not start")
        time.sleep(0.02)
    try:
        yield LiveService(url=f"http://127.0.0.1:{port}", app=app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
