"""Benchmark: a fleet of simulated agents against one service process on PostgreSQL (loopback).

Each simulated agent is a coroutine with its own keep-alive connections (asyncio on uvloop: no
process, no thread per agent) that does what `ett agent` does on the wire:
- registers, then heartbeats every `--heartbeat` seconds (no long-poll, so a heartbeat's
  latency is the service's work), listing its running attempt in every heartbeat as the real
  agent does;
- carries out the launch commands the scheduler sends back: from then on its "ranks" produce
  events (every rank: init_start, init_end, and a checkpoint's start/staged/committed every
  `--checkpoint` seconds; rank 0: a step every `--step` seconds), which the agent posts as one
  batch per heartbeat period, half a period after its heartbeat, on a connection and schedule of
  their own as the real agent's forwarder does; a batch that fails is sent again.
Jobs of `--nodes-per-job` nodes are submitted once all agents are registered, so the service's
own scheduler allocates every node. The first `--warmup` seconds (the launches) are not measured;
after `--duration` more seconds the agents stop, send what they hold, and the events stored in
PostgreSQL are counted against the events generated.

Latencies are measured by the client, per request, from send to answer (they include the load
generator's own delays, so they are an upper bound; its garbage collector is off while it drives
the load, so that its pauses are not among them); the service's own histogram
(ett_http_request_duration_seconds, from /metrics) gives the server's view of the same window.

    .venv/bin/python bench/load_agents.py --agents 2048 --warmup 30 --duration 60
"""

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import sqlalchemy as sa
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_forward import wait_ready  # noqa: E402
from service.db import make_engine, make_session_factory  # noqa: E402
from service.migrate import upgrade  # noqa: E402
from service.models import JobEvent, Role  # noqa: E402
from service.security import create_token  # noqa: E402
from tests.support.postgres import free_port, postgres_server  # noqa: E402


@dataclass
class Load:
    agents: int
    nodes_per_job: int
    ranks_per_node: int
    heartbeat: float
    step: float
    checkpoint: float
    duration: float
    warmup: float
    workers: int  # service processes


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    sent_at: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # beside latencies
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    generated: int = 0
    accepted: int = 0
    duplicates: int = 0
    measure_from: float = 0.0  # perf_counter time: latencies of requests sent earlier are not kept (warm-up)

    async def call(self, kind: str, connection: "AgentConnection", path: str, body: dict) -> dict | None:
        started = time.perf_counter()
        try:
            status, answer = await connection.post(path, body)
        except (OSError, EOFError, TimeoutError, ValueError) as exc:  # ValueError: a malformed answer
            connection.close()
            self.errors[f"{kind}: {type(exc).__name__}"] += 1
            return None
        if started >= self.measure_from or kind == "register":
            self.latencies[kind].append(time.perf_counter() - started)
            self.sent_at[kind].append(started - self.measure_from)
        if status != 200:
            self.errors[f"{kind}: HTTP {status}"] += 1
            return None
        return answer


class AgentConnection:
    """One agent's keep-alive HTTP/1.1 connection to the service: POST JSON, read the JSON answer
    (uvicorn always sends Content-Length). A client this small costs the load generator a sixth of
    httpx's CPU per request; with httpx, the generator (one process) saturated its core before the
    service did at 2,048 agents, and its own delays dominated the latencies it measured."""

    # Idle connections are closed before the service's keep-alive (20 s) would close them, as
    # httpx does, so no request is sent on a connection the service is closing.
    KEEPALIVE_SECONDS = 10.0

    def __init__(self, host: str, port: int, token: str, timeout: float = 60.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.idle_since = 0.0
        self.head = f"Host: {host}:{port}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict) -> tuple[int, dict | None]:
        payload = json.dumps(body).encode()
        request = f"POST {path} HTTP/1.1\r\n{self.head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload
        if self.writer is not None and time.monotonic() - self.idle_since > self.KEEPALIVE_SECONDS:
            self.close()
        async with asyncio.timeout(self.timeout):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.write(request)
            answer = await self._answer()
        self.idle_since = time.monotonic()
        return answer

    async def _answer(self) -> tuple[int, dict | None]:
        status = int((await self.reader.readuntil(b"\r\n")).split()[1])
        length, close = 0, False
        while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
            elif name.lower() == b"connection" and value.strip().lower() == b"close":
                close = True
        body = await self.reader.readexactly(length)
        if close:
            self.close()
        return status, json.loads(body) if status == 200 else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class SimAgent:
    def __init__(self, name: str, token: str, load: Load) -> None:
        self.name, self.token, self.load = name, token, load
        self.launch: dict | None = None
        self.launched_at = 0.0
        self.seq: dict[str, int] = defaultdict(int)
        self.unsent: list[dict] = []
        self.steps_done = 0
        self.checkpoints_done = 0

    def _event(self, kind: str, rank: int, ts: float, step: int | None = None, **data) -> dict:
        source = f"rank:{rank}"
        self.seq[source] += 1
        return {"job_id": self.launch["job_id"], "kind": kind, "ts": ts, "attempt": self.launch["attempt"],
                "source": source, "seq": self.seq[source], "step": step, "data": data}  # fmt: skip

    def produce(self, now: float) -> int:
        """Appends the events its ranks wrote since the last call; returns how many."""
        if self.launch is None:
            return 0
        before = len(self.unsent)
        ranks = range(self.launch["node_rank"] * self.load.ranks_per_node,
                       (self.launch["node_rank"] + 1) * self.load.ranks_per_node)  # fmt: skip
        if not self.seq:
            for rank in ranks:
                self.unsent += [self._event("init_start", rank, self.launched_at, pid=rank),
                                self._event("init_end", rank, self.launched_at)]  # fmt: skip
        running = now - self.launched_at
        while (self.steps_done + 1) * self.load.step <= running:
            self.steps_done += 1
            if self.launch["node_rank"] == 0:
                end = self.launched_at + self.steps_done * self.load.step
                self.unsent.append(self._event("step", 0, end, self.steps_done, duration=self.load.step, tokens=4096))
        while (self.checkpoints_done + 1) * self.load.checkpoint <= running:
            self.checkpoints_done += 1
            at = self.launched_at + self.checkpoints_done * self.load.checkpoint
            step = int(self.checkpoints_done * self.load.checkpoint / self.load.step)
            for rank in ranks:
                self.unsent += [
                    self._event("ckpt_start", rank, at, step),
                    self._event("ckpt_staged", rank, at + 0.1, step),
                    self._event("ckpt_committed", rank, at + 1, step, path=f"/ckpt/{step}", bytes=1 << 20),
                ]
        return len(self.unsent) - before

    async def heartbeat(self, client: AgentConnection, tally: Tally) -> None:
        attempts = [] if self.launch is None else [
            {"job_id": self.launch["job_id"], "attempt": self.launch["attempt"], "state": "running"}]  # fmt: skip
        body = {"clock": time.time(), "attempts": attempts, "stats": {"processes": len(attempts) * 8}}
        answer = await tally.call("heartbeat", client, f"/api/v1/agents/{self.name}/heartbeat", body)
        for command in (answer or {}).get("commands", []):
            if command["type"] == "launch":
                self.launch, self.launched_at = command, time.time()
                self.seq.clear()
                self.steps_done = self.checkpoints_done = 0

    async def send(self, client: AgentConnection, tally: Tally) -> None:
        tally.generated += self.produce(time.time())
        if not self.unsent:
            return
        batch = self.unsent[:2000]
        answer = await tally.call("events", client, f"/api/v1/agents/{self.name}/events", {"events": batch})
        if answer is not None:  # else: kept, and sent again next period, as the agent's spool does
            del self.unsent[: len(batch)]
            tally.accepted += answer["accepted"]
            tally.duplicates += answer["duplicates"]

    async def run(self, beats: AgentConnection, batches: AgentConnection, tally: Tally, until: float) -> None:
        """Heartbeats and event batches each on their own schedule and connection, as the real
        agent's heartbeat loop and forwarder: a slow batch does not put off the next heartbeat."""
        period = self.load.heartbeat
        await asyncio.sleep(random.uniform(0, period))  # agents start at random phases
        await asyncio.gather(every(period, 0, lambda: self.heartbeat(beats, tally), until),
                             every(period, period / 2, lambda: self.send(batches, tally), until))  # fmt: skip


async def every(period: float, offset: float, call, until: float) -> None:
    """Calls `call` every `period` seconds from `offset` on (at once when a call ran late)."""
    await asyncio.sleep(offset)
    while time.monotonic() < until:
        started = time.monotonic()
        await call()
        await asyncio.sleep(max(0.0, started + period - time.monotonic()))


async def drive(url: str, load: Load, admin: str, user: str, agents: list[SimAgent]) -> dict:
    tally = Tally()
    # A connection per agent, as each real agent has (a client shared by thousands of agents would
    # measure its own queueing). httpx only for the user's and the scrapes' few requests.
    address = httpx.URL(url)
    own = {a.name: AgentConnection(address.host, address.port, a.token) for a in agents}
    forwarders = {a.name: AgentConnection(address.host, address.port, a.token) for a in agents}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        gate = asyncio.Semaphore(64)

        async def register(agent: SimAgent) -> None:
            async with gate:
                body = {"name": agent.name, "address": "127.0.0.1", "slots": load.ranks_per_node}
                await tally.call("register", own[agent.name], "/api/v1/agents/register", body)

        await asyncio.gather(*(register(a) for a in agents))
        for i in range(len(agents) // load.nodes_per_job):
            spec = {"name": f"load-{i}", "nodes": load.nodes_per_job, "procs_per_node": load.ranks_per_node,
                    "entrypoint": ["true"]}  # fmt: skip
            while (response := await client.post("/api/v1/jobs", json=spec, headers={"Authorization": f"Bearer {user}"})
                   ).status_code == 429:  # the user's own rate limit: submit at the pace it allows
                await asyncio.sleep(float(response.headers["Retry-After"]))
            response.raise_for_status()
        started = time.monotonic()
        tally.measure_from = time.perf_counter() + load.warmup
        until = started + load.warmup + load.duration
        runs = asyncio.gather(*(a.run(own[a.name], forwarders[a.name], tally, until) for a in agents))
        await asyncio.sleep(load.warmup)  # the launches: allocation, first events
        measured = time.monotonic()
        before = await server_histogram(client)
        await runs
        window = min(time.monotonic(), until) - measured  # agents finish their last period after `until`
        after = await server_histogram(client)
        # What is still held goes out now, as an agent's forwarder would on exit (for 2 minutes at
        # most: what is left after that counts as lost).
        flush_until = time.monotonic() + 120

        async def flush(agent: SimAgent) -> None:
            while agent.unsent and time.monotonic() < flush_until:
                await agent.send(forwarders[agent.name], tally)
                if agent.unsent:
                    await asyncio.sleep(1)

        await asyncio.gather(*(flush(a) for a in agents))
    for connection in [*own.values(), *forwarders.values()]:
        connection.close()
    return {"tally": tally, "window": window, "server": {k: after[k] - before.get(k, 0) for k in after}}


async def server_histogram(client: httpx.AsyncClient) -> dict[tuple[str, str], float]:
    """Cumulative counts of ett_http_request_duration_seconds by (route, le), from /metrics."""
    counts: dict[tuple[str, str], float] = defaultdict(float)
    try:
        text = (await client.get("/metrics", timeout=180)).text
    except httpx.HTTPError:  # an overloaded service may not answer: the client's figures remain
        return counts
    for line in text.splitlines():
        if line.startswith("ett_http_request_duration_seconds_bucket{"):
            labels, value = line[line.index("{") + 1 :].rsplit("} ", 1)
            found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            counts[(found["route"], found["le"])] += float(value)
    return counts


def percentile(values: list[float], q: float) -> float:
    # inclusive: a quantile between observed values, never beyond the largest (as exclusive may be)
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=2048)
    parser.add_argument("--nodes-per-job", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--heartbeat", type=float, default=5.0, help="seconds between an agent's heartbeats")
    parser.add_argument("--step", type=float, default=1.0, help="seconds per training step (rank 0's step events)")
    parser.add_argument("--checkpoint", type=float, default=60.0, help="seconds between checkpoints (every rank)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load measured, after the warm-up")
    parser.add_argument("--warmup", type=float, default=0.0,
                        help="seconds of load first, not measured (the jobs' launches: allocation, first events)")
    parser.add_argument("--workers", type=int, default=1, help="service processes (`ett service --workers`)")
    parser.add_argument("--by-window", type=float, metavar="SECONDS",
                        help="also print p50/p99 per window of this many seconds of the measured load")
    parser.add_argument("--seed", type=int, default=0, help="of the agents' random phases (the same load in every run)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--service-log", type=Path, default=Path(tempfile.gettempdir()) / "ett-load-service.log")
    args = parser.parse_args()
    random.seed(args.seed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the service and PostgreSQL are stopped
    load = Load(args.agents, args.nodes_per_job, args.ranks_per_node, args.heartbeat, args.step, args.checkpoint,
                args.duration, args.warmup, args.workers)  # fmt: skip
    with postgres_server("ett_load") as database_url, tempfile.TemporaryDirectory(prefix="ett-load-") as root:
        upgrade(database_url)
        engine = make_engine(database_url)
        with make_session_factory(engine)() as session:
            admin, user = create_token(session, Role.admin, "admin"), create_token(session, Role.user, "load")
            agents = [SimAgent(f"node-{i:04d}", create_token(session, Role.agent, f"node-{i:04d}"), load)
                      for i in range(load.agents)]  # fmt: skip
            session.commit()
        port = free_port()
        env = os.environ | {"ETT_DATABASE_URL": database_url, "ETT_PORT": str(port), "ETT_DATA_DIR": root}
        log = open(args.service_log, "wb")
        command = [sys.executable, "-m", "ett_cli.main", "service", "--workers", str(load.workers)]
        service = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, service, log.name)
            # No collector in the generator while it drives: its full collections took 130 to 225
            # ms around the checkpoint burst, every agent stalled at once, and the stall was
            # measured as the service's latency and then sent as a burst of held-back requests.
            # What it allocates is freed by reference counting (with 2,048 agents, 185 MB
            # resident at most, the service included).
            gc.freeze()
            gc.disable()
            try:
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    result = runner.run(drive(url, load, admin, user, agents))
            finally:
                gc.enable()
        finally:
            service.terminate()
            try:
                service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait()
        with engine.connect() as conn:
            def count(*where) -> int:
                return conn.scalar(sa.select(sa.func.count()).select_from(JobEvent).where(*where))

            stored = count(JobEvent.source != "service")
            failed, allocated = count(JobEvent.kind == "attempt_failed"), count(JobEvent.kind == "attempt_allocated")
        engine.dispose()
    report(load, result, stored, failed, allocated, args.json)
    if args.by_window:
        report_windows(result["tally"], args.by_window)


def report_windows(tally: Tally, seconds: float) -> None:
    """Where the slow requests were: p50/p99 per window of the measured load (when a request was sent)."""
    print(f"  by window of {seconds:g} s (sent at):")
    for kind in sorted(k for k in tally.latencies if k != "register"):
        windows: dict[int, list[float]] = defaultdict(list)
        for sent, latency in zip(tally.sent_at[kind], tally.latencies[kind], strict=True):
            windows[int(sent // seconds)].append(latency)
        for w, values in sorted(windows.items()):
            print(f"    {kind:10} {w * seconds:>5g} s {len(values):>6} requests, p50 {1000 * percentile(values, 0.5):7.1f} ms, "
                  f"p99 {1000 * percentile(values, 0.99):7.1f} ms")


def report(load: Load, result: dict, stored: int, failed: int, allocated: int, json_path: Path | None) -> None:
    tally: Tally = result["tally"]
    figures: dict = {"machine": f"{platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
                     "load": vars(load), "window_seconds": round(result["window"], 1), "requests": {}}  # fmt: skip
    print(f"{load.agents} agents, heartbeat every {load.heartbeat:g} s, {load.agents // load.nodes_per_job} jobs "
          f"of {load.nodes_per_job} nodes; {result['window']:.0f} s of load measured after {load.warmup:g} s of "
          f"warm-up on {figures['machine']}")
    print(f"  {'request':10} {'count':>8} {'per s':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for kind, values in sorted(tally.latencies.items()):
        row = {"count": len(values), "p50_ms": 1000 * percentile(values, 0.5),
               "p99_ms": 1000 * percentile(values, 0.99), "max_ms": 1000 * max(values)}  # fmt: skip
        figures["requests"][kind] = row
        rate = len(values) / result["window"] if kind != "register" else float("nan")
        print(f"  {kind:10} {row['count']:>8} {rate:>7.1f} {row['p50_ms']:>8.1f} {row['p99_ms']:>8.1f} "
              f"{row['max_ms']:>8.1f}")
    server = result["server"]
    for route in sorted({r for r, _ in server if "/agents/" in r}):
        total = server.get((route, "+Inf"), 0)
        under = server.get((route, "0.1"), 0)
        if total:
            # Each process keeps its own histogram: with several, /metrics shows the one that answered.
            whose = "" if load.workers == 1 else f" (one of {load.workers} processes)"
            print(f"  server side{whose} {route}: {under / total:.2%} of {total:.0f} served within 100 ms")
            figures["requests"].setdefault("server", {})[route] = {"served": total, "within_100ms": under / total}
    errors = dict(tally.errors)
    figures |= {"errors": errors, "events_generated": tally.generated, "events_accepted": tally.accepted,
                "events_duplicates": tally.duplicates, "events_stored": stored, "attempts_allocated": allocated,
                "attempts_failed": failed}  # fmt: skip
    print(f"  errors: {errors or 'none'}; attempts allocated {allocated}, failed {failed}")
    print(f"  events generated {tally.generated}, accepted {tally.accepted} (+{tally.duplicates} repeats), "
          f"stored {stored}: {'nothing lost' if stored == tally.generated else f'{tally.generated - stored} missing'}")
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
