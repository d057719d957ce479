"""Benchmark: the job page (figures + SVG timeline) against the ETT report it is built on.

For each size (rank 0 step events over 10 attempts, each restoring the previous attempt's last
checkpoint), a SQLite job is filled through the ingestion code (service.ingest.store, no HTTP), then
GET /jobs/{id} and its baseline GET /api/v1/jobs/{id}/ett are requested in turn through
FastAPI's in-process client. Figures: wall p50 per request, and process CPU ms per request (less
sensitive to a shared machine's load), plus the page's size and SVG element count. Usage:

    .venv/bin/python bench/job_page.py --sizes 1000 10000 100000 --repeat 5
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.context import context_of  # noqa: E402
from service.ingest.store import ingest  # noqa: E402
from service.main import create_app  # noqa: E402
from service.migrate import upgrade  # noqa: E402
from service.models import Role  # noqa: E402
from service.schemas.events import EventIn  # noqa: E402
from service.security import create_token  # noqa: E402
from service.settings import Settings  # noqa: E402

ATTEMPTS = 10
CHECKPOINT_EVERY = 1000


def timeline(n_steps: int, t0: float) -> list[dict]:
    """10 attempts of n_steps/10 steps of 0.1 s; each fails 300 steps after its last checkpoint."""
    events, t, start = [], t0, 0
    per_attempt = n_steps // ATTEMPTS
    for a in range(ATTEMPTS):
        seq = {"service": 0, "rank:0": 0}

        def add(kind: str, ts: float, source: str, step: int | None = None, **data) -> None:
            seq[source] += 1
            events.append({"kind": kind, "ts": ts, "attempt": a, "source": source, "seq": seq[source],
                           "step": step, "data": data})  # fmt: skip

        add("attempt_allocated", t, "service", nodes=["n1"])
        add("init_end", t + 5, "rank:0")
        t += 5
        if a:
            add("restore_start", t, "rank:0", start)
            add("restore_end", t + 2, "rank:0", start)
            t += 2
        last_saved = start
        for step in range(start + 1, start + per_attempt + 1):
            t += 0.1
            add("step", t, "rank:0", step, duration=0.1)
            if step % CHECKPOINT_EVERY == 0 and step < start + per_attempt - 300:
                add("ckpt_start", t, "rank:0", step)
                add("ckpt_staged", t + 0.5, "rank:0", step)
                add("ckpt_committed", t + 2, "rank:0", step, path=f"/ckpt/{step}", bytes=1)
                t, last_saved = t + 0.5, step
        if a < ATTEMPTS - 1:
            add("attempt_failed", t + 1, "service", cause="signal")
            t, start = t + 10, last_saved
    events.append({"kind": "job_finished", "ts": t + 1, "attempt": ATTEMPTS - 1, "source": "service",
                   "seq": 10**6, "step": None, "data": {"state": "succeeded"}})  # fmt: skip
    return events


def timed(client: TestClient, path: str, repeat: int) -> tuple[float, float, str]:
    walls, cpu = [], time.process_time()
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.get(path)
        walls.append(time.perf_counter() - started)
        assert response.status_code == 200, response.text[:300]
    return statistics.median(walls) * 1000, (time.process_time() - cpu) / repeat * 1000, response.text


def run(n_steps: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/ett.db"
        upgrade(url)
        app = create_app(Settings(database_url=url, data_dir=Path(folder) / "data"))
        with TestClient(app) as client:
            with context_of(app).sessions() as session:
                user = create_token(session, Role.user, "bench")
                session.commit()
            client.headers["Authorization"] = f"Bearer {user}"
            spec = {"name": "bench-page", "nodes": 64}  # more nodes than exist: the scheduler leaves it
            job_id = client.post("/api/v1/jobs", json=spec).json()["id"]
            events = timeline(n_steps, time.time() - n_steps * 0.2)
            for i in range(0, len(events), 20_000):
                with context_of(app).sessions() as session:
                    ingest(session, [(job_id, EventIn.model_validate(e)) for e in events[i : i + 20_000]])
                    session.commit()
            api_wall, api_cpu, _ = timed(client, f"/api/v1/jobs/{job_id}/ett", repeat)
            page_wall, page_cpu, html = timed(client, f"/jobs/{job_id}", repeat)
            elements = html.count("<rect") + html.count('class="failure-mark"')
            print(f"{n_steps:>8} steps  page p50 {page_wall:8.1f} ms  cpu {page_cpu:8.1f} ms"
                  f" | report p50 {api_wall:6.1f} ms  cpu {api_cpu:6.1f} ms"
                  f" | {len(html) // 1024} KiB, {elements} SVG shapes")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, python {platform.python_version()}")  # fmt: skip
    for size in args.sizes:
        run(size, args.repeat)


if __name__ == "__main__":
    main()
