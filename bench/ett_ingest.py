"""Benchmark: event ingestion throughput and GET /ett latency (figures go in BENCHMARKS.md).

For each backend (SQLite file, throwaway PostgreSQL) and each size (step events in the job):
- the engine alone: the same events through service.accounting.memory.MemoryJob (events/s);
- HTTP: one uvicorn process serving the app; one client posts pre-encoded batches to the admin
  replay endpoint, one after the other (events/s, client and server on the same machine);
- GET /api/v1/jobs/{id}/ett latency (p50/p99 over sequential requests), against two baselines
  measured in the same run: GET /healthz (the floor of an HTTP round trip on this machine now,
  requested in turn with GET /ett)
  and what a service without per-job aggregates would pay: reading the job's events and folding
  them. Wall-clock figures depend on the machine's load; the server process's CPU seconds
  (from /proc) are given beside them: events per server CPU-second, server CPU ms per GET, and
  on PostgreSQL the database server's CPU per event (its processes share the same cores).

The timeline: attempt 0 runs half the steps and fails, attempt 1 restores the last checkpoint and
runs the rest; a checkpoint every 100 steps. Usage:

    .venv/bin/python bench/ett_ingest.py --sizes 1000 100000 1000000 --backends sqlite postgresql
"""

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from sqlalchemy import make_url, select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.accounting.engine import Event  # noqa: E402
from service.accounting.memory import MemoryJob  # noqa: E402
from service.db import make_engine, make_session_factory  # noqa: E402
from service.migrate import upgrade  # noqa: E402
from service.models import JobEvent, Role  # noqa: E402
from service.security import create_token  # noqa: E402
from tests.support.postgres import free_port, postgres_server  # noqa: E402

BATCH = 5000
CHECKPOINT_EVERY = 100


def timeline(n_steps: int, t0: float) -> list[dict]:
    events, seq, t = [], {}, t0

    def add(kind, attempt, source, step=None, **data):
        key = (attempt, source)
        seq[key] = seq.get(key, -1) + 1
        events.append({"kind": kind, "ts": t, "attempt": attempt, "source": source, "seq": seq[key],
                       "step": step, "data": data})  # fmt: skip

    half, last_ckpt = n_steps // 2, 0
    for attempt, (first, last) in enumerate(((1, half), (None, n_steps))):
        add("attempt_allocated", attempt, "service", nodes=["n1"])
        t += 1.0
        add("init_start", attempt, "rank:0")
        t += 2.0
        add("init_end", attempt, "rank:0")
        if attempt:
            add("restore_start", attempt, "rank:0")
            t += 0.5
            add("restore_end", attempt, "rank:0", last_ckpt)
            first = last_ckpt + 1
        for step in range(first, last + 1):
            t += 0.1
            add("step", attempt, "rank:0", step, duration=0.09, tokens=4096, loss=2.0)
            if step % CHECKPOINT_EVERY == 0:
                add("ckpt_start", attempt, "rank:0", step)
                t += 0.01
                add("ckpt_staged", attempt, "rank:0", step)
                add("ckpt_committed", attempt, "rank:0", step, path=f"/ckpt/{step}", bytes=1 << 20)
                last_ckpt = step
        if attempt == 0:
            t += 0.5
            add("attempt_failed", attempt, "service", cause="signal", detail="bench")
            t += 5.0
    add("job_finished", 1, "service", state="succeeded")
    return events


def engine_rate(events: list[dict]) -> float:
    job = MemoryJob("bench")
    parsed = [Event(**e) for e in events]
    started = time.perf_counter()
    for lo in range(0, len(parsed), BATCH):
        job.ingest(parsed[lo : lo + BATCH])
    return len(parsed) / (time.perf_counter() - started)


def cpu_seconds(pid: int, *, with_children: bool = False) -> float:
    """User + system CPU time of a process (Linux /proc), and of its children that have exited."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if with_children else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def database_cpu_seconds(database_url: str) -> float | None:
    """CPU time of the PostgreSQL server behind the URL: its postmaster and every backend it
    forked (None for SQLite, whose work is done inside the service process)."""
    if not database_url.startswith("postgresql"):
        return None
    port = make_url(database_url).port
    processes = {}  # pid -> (parent pid, argv)
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            processes[int(proc.name)] = (parent, (proc / "cmdline").read_bytes().split(b"\0"))
        except (OSError, IndexError):  # gone meanwhile
            continue
    postmaster = next(pid for pid, (_, argv) in processes.items()
                      if argv[0].endswith(b"postgres") and str(port).encode() in argv)  # fmt: skip
    backends = [pid for pid, (parent, _) in processes.items() if parent == postmaster]
    return cpu_seconds(postmaster, with_children=True) + sum(cpu_seconds(pid) for pid in backends)


@contextmanager
def served(database_url: str, data_dir: Path):
    """One uvicorn process serving the app on loopback."""
    port = free_port()
    # No agents exist, so the scheduler has nothing to do: its periodic tick is slowed down so
    # that its work is not counted in the server's CPU time. The one client would trip the
    # per-client rate limit: it is off.
    env = os.environ | {"ETT_DATABASE_URL": database_url, "ETT_DATA_DIR": str(data_dir),
                        "ETT_SCHEDULER_PERIOD_SECONDS": "3600", "ETT_RATE_LIMIT_PER_SECOND": "0"}
    argv = [sys.executable, "-m", "uvicorn", "service.main:create_app", "--factory", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--no-access-log"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a loaded machine imports slowly
        while True:
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the service did not start (exit code {proc.poll()})")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def naive_report_ms(sessions, job_id: str, repeats: int) -> float:
    """Baseline: a report computed from the job's stored events on every request."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        with sessions() as session:
            rows = session.execute(
                select(JobEvent.kind, JobEvent.ts, JobEvent.attempt, JobEvent.source, JobEvent.seq, JobEvent.step,
                       JobEvent.data).where(JobEvent.job_id == job_id)  # fmt: skip
            ).all()
        job = MemoryJob(job_id)
        job.ingest([Event(*r) for r in rows])
        job.report(time.time())
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def run_backend(database_url: str, sizes: list[int], gets: int, naive_max: int, data_dir: Path) -> list[dict]:
    upgrade(database_url)
    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    with sessions() as session:
        admin, user = create_token(session, Role.admin, "bench"), create_token(session, Role.user, "bench")
        session.commit()
    results = []
    with served(database_url, data_dir) as (url, pid):
        admin_client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=600)
        user_client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {user}"}, timeout=60)
        for n in sizes:
            spec = {"name": f"bench-{n}", "nodes": 64, "procs_per_node": 1}  # never scheduled: no agents
            job_id = user_client.post("/api/v1/jobs", json=spec).raise_for_status().json()["id"]
            events = timeline(n, time.time() - n * 0.2 - 3600)
            bodies = [json.dumps({"events": events[lo : lo + BATCH]}).encode() for lo in range(0, len(events), BATCH)]
            started, cpu, db_cpu = time.perf_counter(), cpu_seconds(pid), database_cpu_seconds(database_url)
            for body in bodies:
                admin_client.post(f"/api/v1/jobs/{job_id}/events", content=body,
                                  headers={"content-type": "application/json"}).raise_for_status()  # fmt: skip
            http_rate = len(events) / (time.perf_counter() - started)
            http_cpu_rate = len(events) / (cpu_seconds(pid) - cpu)
            if db_cpu is not None:
                db_cpu = (database_cpu_seconds(database_url) - db_cpu) / len(events) * 1e6
            cpu = cpu_seconds(pid)
            for _ in range(gets):
                user_client.get(f"/api/v1/jobs/{job_id}/ett").raise_for_status()
            get_cpu_ms = (cpu_seconds(pid) - cpu) / gets * 1000
            # Latency: the two requests alternate, so that the floor sees the same moments of load.
            latencies, floor = [], []
            for _ in range(gets):
                for path, samples in ((f"/api/v1/jobs/{job_id}/ett", latencies), ("/healthz", floor)):
                    t = time.perf_counter()
                    user_client.get(path).raise_for_status()
                    samples.append((time.perf_counter() - t) * 1000)
            report = user_client.get(f"/api/v1/jobs/{job_id}/ett").json()
            result = {
                "backend": engine.dialect.name, "step_events": n, "events": len(events),
                "engine_events_per_s": round(engine_rate(events)),
                "http_events_per_s": round(http_rate),
                "http_events_per_server_cpu_s": round(http_cpu_rate),
                "database_cpu_us_per_event": round(db_cpu, 1) if db_cpu is not None else None,
                "get_ett_p50_ms": round(percentile(latencies, 0.5), 2),
                "get_ett_p99_ms": round(percentile(latencies, 0.99), 2),
                "get_ett_server_cpu_ms": round(get_cpu_ms, 2),
                "healthz_p50_ms": round(percentile(floor, 0.5), 2),
                "healthz_p99_ms": round(percentile(floor, 0.99), 2),
                "naive_report_ms": round(naive_report_ms(sessions, job_id, 3), 1) if n <= naive_max else None,
                "ett_percent": round(report["ett_percent"], 3),
                "load1": float(Path("/proc/loadavg").read_text().split()[0]),
            }
            print(json.dumps(result), flush=True)
            results.append(result)
    engine.dispose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    parser.add_argument("--backends", nargs="+", choices=["sqlite", "postgresql"], default=["sqlite", "postgresql"])
    parser.add_argument("--gets", type=int, default=300, help="GET /ett requests per size")
    parser.add_argument("--naive-max", type=int, default=100_000, help="largest size to time the naive baseline at")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the servers started here are stopped
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, load {load}, Python {platform.python_version()}", flush=True)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ett-bench-")))
        for backend in args.backends:
            if backend == "sqlite":
                url = f"sqlite:///{tmp / 'bench.db'}"
            else:
                url = stack.enter_context(postgres_server(database="ett_bench"))
            run_backend(url, args.sizes, args.gets, args.naive_max, tmp / backend)


if __name__ == "__main__":
    main()
