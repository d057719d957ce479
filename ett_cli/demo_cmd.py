"""`ett demo`: a service, three agents and a 2-node MoE job that survives a SIGKILL, a hang and
the loss of a node.

Everything is real: the service on SQLite in a temporary folder, three agent daemons (three
"nodes" on this machine, one a spare), torchrun ranks training the MoE model with expert
parallelism and ZeRO-3 on gloo, faults injected by the agents: the last one takes a node down
with its local disk (its agent, its ranks, its snapshots), and the job goes on on the spare from
the copies of the lost ranks' snapshots its peers kept. The demo prints the ETT report and exits 0
when the job succeeded.
"""

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from ett_cli.render import report_table

DEMO_STEPS = 60
# Ctrl-C, `kill`, the terminal closed: each stops the demo's service and agents as well.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="run a 2-node MoE job with injected failures and print its ETT report")
    parser.add_argument("--keep", action="store_true", help="keep the demo's folder (logs, database, checkpoints)")
    parser.add_argument("--port", type=int, default=0, help="service port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    parser.add_argument("--exit", action="store_true",
                        help="exit after the report even on a terminal (without a terminal it always does)")
    parser.set_defaults(run=run)


def demo_job() -> dict[str, Any]:
    return {
        "name": "demo-moe-2x2",
        "nodes": 2,
        "procs_per_node": 2,
        "trainer": {"preset": "cpu-demo", "overrides": {"train.steps": DEMO_STEPS, "parallel.ep": 2,
                                                        "parallel.zero": 3}},
        "max_restarts": 3,
        # Persistent checkpoints every 10 steps, and each rank's local snapshot after every step.
        "checkpoint": {"interval_steps": 10, "keep": 3, "dir": None, "snapshots": True},
        "hang_timeout_seconds": 20,
        # A rank of node 0 is SIGKILLed in the first attempt; a rank of node 1 hangs in the second;
        # in the third, node 1 is lost (agent, ranks and local disk) and the spare takes its place.
        "faults": [
            {"attempt": 0, "rank": 1, "at_step": 25, "action": "kill"},
            {"attempt": 1, "rank": 2, "at_step": 45, "action": "hang"},
            {"attempt": 2, "rank": 2, "at_step": 52, "action": "lose_node"},
        ],
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ett(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "ett_cli.main", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _token(role: str, subject: str, env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, "-m", "ett_cli.main", "token", "create", "--role", role,
                             "--subject", subject], env=env, capture_output=True, text=True, check=True)
    return result.stdout.strip()


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for signum in STOP_SIGNALS:  # a second Ctrl-C must not cut this short
            signal.signal(signum, signal.SIG_IGN)
        # Agents first (they stop their ranks), the service last.
        for proc in reversed(started):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20  # for all of them together: then SIGKILL
        for proc in reversed(started):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _job_user_settings(root: Path) -> tuple[dict[str, str], int]:
    """The demo's agents' job user settings and its uid. As root, they run the job as nobody where
    it can run this interpreter (one user: the demo has one owner, and its warm servers then start
    with the agents, as on a cluster whose agents have served that owner before); where it cannot
    (an interpreter under root's home folder), as root, said explicitly (ETT_AGENT_ALLOW_ROOT_JOBS)
    and printed: these agents serve this demo only."""
    from agent.confinement.job_user import RunAs, resolve_job_user

    if os.geteuid() != 0:
        return {}, os.geteuid()
    root.chmod(0o755)  # mkdtemp's folder is closed to other users
    nobody = resolve_job_user("nobody", allow_root=False)
    problem = RunAs(sys.executable, nobody).problem([root])
    if problem is None:
        return {"ETT_AGENT_JOB_USER": "nobody"}, nobody.uid
    print(f"ett demo: the demo's agents run its job as root, since {problem.split(';')[0]} "
          "(a real agent refuses to start then: docs/agent.md, \"The job's user\")")
    return {"ETT_AGENT_JOB_USER": "root", "ETT_AGENT_ALLOW_ROOT_JOBS": "true"}, 0


def _wait_warm(data_dirs: list[Path], uid: int, agents: list[subprocess.Popen], timeout: float = 30) -> float:
    """Waits until each agent's warm server for the job's user has done its imports (agent/warm/server.py),
    as on a cluster whose agents were up before the job came: a job allocated earlier would wait
    for them inside its window. Returns the seconds waited; gives up quietly after `timeout` (the
    job then starts cold)."""
    from agent.warm.servers import socket_path
    from agent.warm.sockets import socket_folder

    sockets = [socket_path(socket_folder(folder), uid) for folder in data_dirs]  # where each agent binds them
    started = time.monotonic()
    while time.monotonic() - started < timeout and any(agent.poll() is None for agent in agents):
        if all(sock.exists() for sock in sockets):
            break
        time.sleep(0.1)
    return time.monotonic() - started


def _wait_ready(url: str, service: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if service.poll() is not None:
            raise SystemExit(f"ett demo: the service exited; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"ett demo: the service did not answer; see {log}")


class Progress:
    """The job's live progress (attempt, step, ETT so far): one line rewritten in place on a
    terminal; elsewhere (logs, CI) a line every 10 steps."""

    def __init__(self, terminal: bool) -> None:
        self.terminal = terminal
        self.width = 0  # of the line on screen
        self.tens = -1  # the last step's tens printed, off a terminal

    def show(self, attempt: int, report: dict[str, Any]) -> None:
        step = report["last_step"]
        if step is None:
            return
        line = f"  attempt {attempt}: step {step}/{DEMO_STEPS}, ETT so far {report['ett_percent']:.1f}%"
        if self.terminal:
            print("\r" + line.ljust(self.width), end="", flush=True)
            self.width = len(line)
        elif step // 10 != self.tens:
            print(line, flush=True)
            self.tens = step // 10

    def clear(self) -> None:
        """Before another line is printed: the progress line goes."""
        if self.terminal and self.width:
            print("\r" + " " * self.width + "\r", end="", flush=True)
            self.width = 0


def _follow(client: httpx.Client, job_id: str, timeout: float, progress: Progress) -> dict[str, Any]:
    """Prints each attempt's state changes, and the progress, until the job ends."""
    seen: dict[int, str] = {}
    restored: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/api/v1/jobs/{job_id}").raise_for_status().json()
        for attempt in job["attempts"]:
            number, state = attempt["number"], attempt["state"]
            if number not in seen:  # allocation is printed even when a poll first sees it running
                newest = f" (newest checkpoint: {attempt['resume_from']})" if attempt["resume_from"] else ""
                progress.clear()
                print(f"  attempt {number}: allocated on {', '.join(attempt['nodes'])}{newest}", flush=True)
                seen[number] = "allocated"
            if attempt["restored_step"] is not None and number not in restored:
                restored.add(number)
                progress.clear()
                print(f"  attempt {number}: resumed from step {attempt['restored_step']}", flush=True)
            if seen[number] != state:
                seen[number] = state
                why = f" ({attempt['cause']}: {attempt['detail']})" if attempt["cause"] else ""
                progress.clear()
                print(f"  attempt {number}: {state}{why}", flush=True)
        if job["state"] in ("succeeded", "failed", "cancelled"):
            progress.clear()
            return job
        if job["attempts"] and job["attempts"][-1]["state"] == "running":
            progress.show(job["attempts"][-1]["number"], client.get(f"/api/v1/jobs/{job_id}/ett").json())
        time.sleep(0.5)
    raise SystemExit(f"ett demo: the job did not end within {timeout:.0f} s")


def _stop_everything_on_signals() -> None:
    """Ctrl-C (even where SIGINT came ignored: a background job of a script), SIGTERM and SIGHUP
    (the terminal closed) stop the agents and the service too, not only us: they run in sessions
    of their own, which no terminal signal reaches."""
    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    for signum in STOP_SIGNALS:
        signal.signal(signum, interrupt)


def _stay_up(url: str, job_id: str, user_token: str) -> None:
    """On a terminal: the service stays up, with a login that works, until Ctrl-C."""
    print(f"ett demo: the service stays up: open {url}/jobs/{job_id}?token={user_token}\n"
          f"          (the job's page; signed in as the demo's user), or use the API at {url}/docs with "
          f"ETT_SERVICE_URL={url} ETT_TOKEN={user_token}. Ctrl-C stops everything.", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:  # the way out: the demo itself went well
        print()


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="ett-demo-"))
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    # A lost node is known by its missing heartbeats, and the restart waits for that (its ranks
    # might still run): the demo's agents beat every second, and 6 s of silence is a loss.
    env = {**os.environ, "ETT_DATA_DIR": str(root / "service"), "ETT_PORT": str(port),
           "ETT_HEARTBEAT_TIMEOUT_SECONDS": "6"}
    started = time.monotonic()
    _stop_everything_on_signals()
    print(f"ett demo: working in {root}")
    try:
        job = _run_demo(args, root, env, url, started)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP before the end: _processes stopped everything
        with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
            print("\nett demo: interrupted; the service and agents are stopped", flush=True)
        job = None
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if job is not None and job["state"] == "succeeded" else 1


def _run_demo(args: argparse.Namespace, root: Path, env: dict[str, str], url: str, started: float) -> dict[str, Any]:
    """Service, agents, the job and its report; on a terminal, stays up until interrupted."""
    subprocess.run([sys.executable, "-m", "ett_cli.main", "service", "migrate"], env=env, check=True,
                   capture_output=True)
    with _processes() as procs:
        service_log = root / "service.log"
        procs.append(_ett("service", env=env, log=service_log))
        _wait_ready(url, procs[0], service_log)
        print(f"ett demo: service at {url} (API docs at {url}/docs)")
        job_user, job_uid = _job_user_settings(root)
        data_dirs = [root / f"node-{i}" for i in range(3)]
        for i, data_dir in enumerate(data_dirs):
            agent_env = {**os.environ, **job_user, "ETT_AGENT_SERVICE_URL": url, "ETT_AGENT_NAME": f"node-{i}",
                         "ETT_AGENT_TOKEN": _token("agent", f"node-{i}", env), "ETT_AGENT_SLOTS": "2",
                         "ETT_AGENT_DATA_DIR": str(data_dir), "ETT_AGENT_HEARTBEAT_INTERVAL_SECONDS": "1",
                         "ETT_AGENT_HEARTBEAT_WAIT_SECONDS": "1",
                         "ETT_AGENT_NODE_LOSS_DRILLS": "true"}  # these agents serve the demo only
            procs.append(_ett("agent", env=agent_env, log=root / f"node-{i}.log"))
        waited = _wait_warm(data_dirs, job_uid, procs[1:])
        print(f"ett demo: agents node-0, node-1 and node-2 (a spare) up (2 slots each; ready to launch in "
              f"{waited:.1f} s)")
        user = _token("user", "demo", env)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {user}"}, timeout=30) as client:
            job = client.post("/api/v1/jobs", json=demo_job()).raise_for_status().json()
            print(f"ett demo: submitted job {job['id']}: 2 nodes x 2 ranks, MoE with EP 2 and ZeRO-3, "
                  f"{DEMO_STEPS} steps; faults: SIGKILL of rank 1 at step 25, hang of rank 2 at step 45, "
                  "loss of rank 2's node (agent, ranks, local disk) at step 52")
            job = _follow(client, job["id"], args.timeout, Progress(terminal=sys.stdout.isatty()))
            report = client.get(f"/api/v1/jobs/{job['id']}/ett").raise_for_status().json()
        print()
        print(report_table(report))
        print()
        print(f"ett demo: job {job['state']} in {time.monotonic() - started:.0f} s.")
        if sys.stdin.isatty() and sys.stdout.isatty() and not args.exit:
            _stay_up(url, job["id"], user)
        print(f"ett demo: logs in {root}" if args.keep else "ett demo: done")
    return job
