"""A small real HTTP server speaking the service's agent events endpoint, for forwarder tests
that need to steer its answers (a refusal naming no event, an outage at a chosen moment).

It keeps the first copy of each event by its idempotency key, like the service, counts repeats,
and refuses (422, FastAPI-style `loc`) events whose kind is not a schema-v1 kind. Its store
outlives restarts of the server, so a test can take "the service" down and bring it back.
"""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ett.protocol import EVENT_KINDS


class FakeService:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.events: dict[tuple, dict[str, Any]] = {}
        self.duplicates = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> "FakeService":
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer = service.handle(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        with self._lock:
            if re.fullmatch(r"/api/v1/agents/[^/]+/events", path):
                return self._ingest(body["events"])
        return 404, {"detail": "not found"}

    def _ingest(self, events: list[dict[str, Any]]) -> tuple[int, Any]:
        bad = [{"loc": ["body", "events", i, "kind"], "msg": f"unknown kind {e.get('kind')!r}", "type": "value_error"}
               for i, e in enumerate(events) if e.get("kind") not in EVENT_KINDS]
        if bad:
            return 422, {"detail": bad}
        accepted = 0
        for event in events:
            key = (event["job_id"], event["attempt"], event["source"], event["seq"])
            if key in self.events:
                self.duplicates += 1
            else:
                self.events[key] = event
                accepted += 1
        return 200, {"accepted": accepted, "duplicates": len(events) - accepted}
