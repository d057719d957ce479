"""Benchmark: the heartbeat's latency while the service diagnoses jobs whose failed rank printed one
line of 250 Ki characters (issue #48: the failure patterns were quadratic on such a line and ran in
the heartbeat's write transaction), against jobs whose rank printed a short line, in the same run.

A real service (SQLite) and a real agent run the jobs (a rank prints the line and exits 1); a probe,
registered as a second agent, heartbeats every 20 ms meanwhile and times each answer.

    .venv/bin/python bench/long_line.py --jobs 4
"""

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.service.factories import register_agent  # noqa: E402
from tests.support.cluster import cluster  # noqa: E402

LONG = 250 << 10


def failing_job(line_chars: int) -> dict:
    code = f"import sys; print('(' * {line_chars}, flush=True); sys.exit(1)"  # a line no pattern ends early
    return {"name": f"line-{line_chars}", "nodes": 1, "procs_per_node": 1, "max_restarts": 0,
            "hang_timeout_seconds": None, "entrypoint": [sys.executable, "-c", code]}


def probe_latencies(probe: httpx.Client, run: Callable[[], None]) -> list[float]:
    """Seconds of each of the probe's heartbeats while `run()` runs."""
    latencies: list[float] = []
    done = threading.Event()

    def beat() -> None:
        while not done.is_set():
            started = time.perf_counter()
            response = probe.post("/api/v1/agents/probe/heartbeat", json={"clock": time.time()})
            latencies.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text
            time.sleep(0.02)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        run()
    finally:
        done.set()
        thread.join()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp)) as c:
        c.start_agent("node-a", slots=1)
        probe = c.service.client(c.service.token("agent", "probe"))
        register_agent(probe, "probe", slots=1)
        assert c.admin.post("/api/v1/nodes/probe/drain", json={"reason": "a probe: runs nothing"}).status_code == 200
        for chars in (80, LONG):  # the baseline first, then the long lines, in one run
            def run(chars: int = chars) -> None:
                for job_id in [c.submit(**failing_job(chars)) for _ in range(args.jobs)]:
                    job = c.wait_job(job_id, timeout=300)
                    assert job["attempts"][0]["diagnosis"] is not None, job

            latencies = sorted(probe_latencies(probe, run))
            p50 = statistics.median(latencies)
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            print(f"rank line of {chars} characters, {args.jobs} failed jobs: {len(latencies)} heartbeats, "
                  f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
