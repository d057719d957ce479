"""The service keeps an idle connection open longer than an httpx client keeps it in its pool, so a
client never sends on a connection the service is closing at that moment: that race reset a test's
request in CI (errno 104) when the test service closed idle connections after uvicorn's 5 s."""

import select
import socket
import time

import httpx
import pytest

from service.main import KEEP_ALIVE_SECONDS
from tests.support.live import LiveService


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_an_idle_connection_outlives_an_httpx_clients_pool_expiry(service: LiveService):
    client_expiry = httpx.Limits().keepalive_expiry
    assert KEEP_ALIVE_SECONDS > client_expiry + 5  # a margin for a loaded machine's late timers
    host, port = service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: ett\r\n\r\n")
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(client_expiry + 1)
        # A closed connection would be readable (end of file); an open, idle one is not.
        assert select.select([conn], [], [], 0)[0] == []
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: ett\r\n\r\n")
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
