"""GET /metrics for Prometheus: the ETT figures (service/accounting/metrics.py) and this process's own
request counts and latencies, labelled by route template."""

import math
import time

from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.accounting.metrics import EttCollector
from service.context import context_of


def route_template(scope: Scope) -> str:
    """The matched route's template with its routers' prefixes ("/api/v1/jobs/{job_id}/ett").
    Unknown paths share one label, so probing URLs cannot grow the series."""
    route = scope.get("route")
    regex, template = getattr(route, "path_regex", None), getattr(route, "path_format", None)
    if regex is None or template is None:
        return "unmatched"
    path = scope["path"]
    # The route may know only its own part of the path: the rest before it is the prefixes.
    for i, char in enumerate(path):
        if char == "/" and regex.match(path[i:]):
            return path[:i] + template
    return template


class RequestMetrics:
    """ASGI middleware: request counts and latencies by method, route template and status."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = route_template(scope)
            self.requests.labels(scope["method"], route, str(status)).inc()
            self.latency.labels(scope["method"], route).observe(time.perf_counter() - started)


def install_metrics(app: FastAPI, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Adds GET /metrics and the request middleware; a fresh registry unless one is given."""
    registry = registry if registry is not None else CollectorRegistry()
    context = context_of(app)
    registry.register(EttCollector(context.sessions, context.settings))
    requests = Counter(
        "ett_http_requests", "HTTP requests served by this process.", ["method", "route", "status"], registry=registry
    )
    latency = Histogram(
        "ett_http_request_duration_seconds", "Time to serve HTTP requests in this process.", ["method", "route"],
        registry=registry, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, math.inf),
    )  # fmt: skip
    app.add_middleware(RequestMetrics, requests=requests, latency=latency)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return registry
