"""The service's agent endpoints (docs/architecture.md, "Service REST"), over one httpx client."""

from typing import Any

import httpx

from agent.settings import AgentSettings


class ServiceClient:
    def __init__(self, settings: AgentSettings) -> None:
        self.name = settings.name
        self.timeout = settings.request_timeout_seconds
        self.clock_offset = settings.clock_offset_seconds
        self._http = httpx.Client(
            base_url=f"{settings.service_url}/api/v1",
            headers={"Authorization": f"Bearer {settings.token}"},
            timeout=settings.request_timeout_seconds,
        )

    def register(self, address: str, slots: int, health: str | None = None) -> dict[str, Any]:
        body = {"name": self.name, "address": address, "slots": slots, "health": health}
        response = self._http.post("/agents/register", json=body)
        response.raise_for_status()
        return response.json()

    def heartbeat(self, body: dict[str, Any], wait: float) -> dict[str, Any]:
        if self.clock_offset:
            body = body | {"clock": body["clock"] + self.clock_offset}
        response = self._http.post(f"/agents/{self.name}/heartbeat", params={"wait": wait}, json=body,
                                   timeout=self.timeout + wait)
        response.raise_for_status()
        return response.json()

    def post_events(self, events: list[dict[str, Any]]) -> httpx.Response:
        """The raw answer: the forwarder tells a refused event (422) from an unavailable service."""
        if self.clock_offset:
            events = [e | {"ts": e["ts"] + self.clock_offset} if isinstance(e.get("ts"), int | float) else e
                      for e in events]  # fmt: skip
        return self._http.post(f"/agents/{self.name}/events", json={"events": events})

    def post_logs(self, pieces: list[dict[str, Any]]) -> httpx.Response:
        """New output of the ranks (agent/forwarding/log_shipper.py); the raw answer."""
        return self._http.post(f"/agents/{self.name}/logs", json={"logs": pieces})

    def close(self) -> None:
        self._http.close()
