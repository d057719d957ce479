"""A webhook receiver on loopback, for what the service and Alertmanager send: records every POST
(path, headers, body) and answers with the status the test sets (500: a receiver in trouble)."""

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    url: str
    deliveries: list[Delivery] = field(default_factory=list)
    status: int = 200  # what the next POSTs are answered

    def at(self, path: str) -> list[Delivery]:
        return [d for d in list(self.deliveries) if d.path == path]


@contextmanager
def webhook_receiver() -> Iterator[Receiver]:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status = receiver.status
            if status < 300:  # a failed delivery is not a delivery
                receiver.deliveries.append(Delivery(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def silent_receiver() -> Iterator[str]:
    """A receiver that is down the worst way: it takes the connection and never answers. Its URL."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(64)  # the kernel completes the connections; nobody ever reads them
        yield f"http://127.0.0.1:{listening.getsockname()[1]}"
