"""Benchmark: the agent's event forwarder against the real service (SQLite, its own process, loopback).

A spool of N `step` events (one rank, one job) is forwarded with agent.forwarding.forward.Forwarder, the
code `ett agent` runs, for each batch size asked; batch size 1 (one POST per event) is the
baseline the others are compared with. Each batch size gets a job of its own, so nothing is a
repeat. The rate is events stored per second of wall time, from the first read to the last
accepted batch, read positions persisted (fsynced) after every batch as in the agent.

    .venv/bin/python bench/agent_forward.py --events 20000 --baseline-events 1000 --batches 1 50 500
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agent.forwarding.forward import ForwardConfig, Forwarder  # noqa: E402
from agent.node.metrics import AgentStats  # noqa: E402
from service.db import make_engine, make_session_factory  # noqa: E402
from service.migrate import upgrade  # noqa: E402
from service.models import Role  # noqa: E402
from service.security import create_token  # noqa: E402
from tests.support.postgres import free_port  # noqa: E402


def wait_ready(url: str, service: subprocess.Popen, log: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or service.poll() is not None:
            raise SystemExit(f"the service did not start; see {log}")
        time.sleep(0.2)


def write_spool(path: Path, events: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for seq in range(events):
            event = {"kind": "step", "ts": time.time(), "attempt": 0, "source": "rank:0", "seq": seq,
                     "step": seq + 1, "data": {"duration": 0.1, "tokens": 4096, "loss": 2.5}}
            f.write(json.dumps(event) + "\n")


def forward(url: str, agent_token: str, root: Path, job_id: str, events: int, batch: int) -> float:
    write_spool(root / "spool" / job_id / "0" / "events" / "rank-0.jsonl", events)
    client = httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {agent_token}"}, timeout=60)
    send = lambda batch_events: client.post("/agents/bench-node/events", json={"events": batch_events})  # noqa: E731
    stats = AgentStats()
    forwarder = Forwarder(root / "spool", root, send, stats, ForwardConfig(batch_max_events=batch))
    started = time.perf_counter()
    while stats.events_forwarded < events:
        if not forwarder.forward_once(flush=True):
            raise SystemExit(f"forwarding failed at batch size {batch}")
    elapsed = time.perf_counter() - started
    client.close()
    if stats.dead_letters:
        raise SystemExit(f"{stats.dead_letters} events refused at batch size {batch}; see {root}/dead-letters.jsonl")
    return events / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--baseline-events", type=int, default=1000, help="events sent one per request")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 50, 500])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ett-bench-forward-") as tmp:
        root = Path(tmp)
        database_url = f"sqlite:///{root / 'ett.db'}"
        upgrade(database_url)
        engine = make_engine(database_url)
        with make_session_factory(engine)() as session:
            user, agent = create_token(session, Role.user, "bench"), create_token(session, Role.agent, "bench-node")
            session.commit()
        port = free_port()
        log = root / "service.log"
        env = os.environ | {"ETT_DATABASE_URL": database_url, "ETT_PORT": str(port), "ETT_DATA_DIR": str(root)}
        service = subprocess.Popen([sys.executable, "-m", "ett_cli.main", "service"], env=env,
                                   stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, service, str(log))
            headers = {"Authorization": f"Bearer {agent}"}
            httpx.post(f"{url}/api/v1/agents/register", headers=headers,
                       json={"name": "bench-node", "address": "127.0.0.1", "slots": 1}).raise_for_status()
            rates = {}
            for batch in args.batches:
                spec = {"name": f"bench-{batch}", "entrypoint": ["true"], "max_restarts": 0}
                job = httpx.post(f"{url}/api/v1/jobs", json=spec, headers={"Authorization": f"Bearer {user}"})
                job.raise_for_status()
                events = args.baseline_events if batch == 1 else args.events
                rates[batch] = forward(url, agent, root / f"agent-{batch}", job.json()["id"], events, batch)
        finally:
            service.terminate()
            service.wait(timeout=30)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}; service on SQLite")
    baseline = rates.get(1)
    for batch, rate in rates.items():
        ratio = f" ({rate / baseline:.1f}x batch 1)" if baseline and batch != 1 else ""
        print(f"batch {batch:>5}: {rate:9.0f} events/s{ratio}")


if __name__ == "__main__":
    main()
