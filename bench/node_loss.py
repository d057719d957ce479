"""The recovery benchmark's node-loss scenario (`bench/recovery.py --lose-node`): a 2-node job plus
a spare; at the kill step the whole of one node goes at once (its agent and its ranks, SIGKILL).

- ETT: a live service and three real agents on the agents' default heartbeat settings (3 s period,
  3 s long-poll; the service's 30 s deadline); the node that goes is attempt 0's second node. The
  service learns of the loss from the survivors' broken collectives (service/jobs/peer_loss.py)
  and restarts on the spare.
- baseline: torchrun's own elastic answer, on the same trainer (bench/baseline_train.py): one
  `torchrun --nnodes 2 --rdzv-backend c10d --max-restarts 1` per node on loopback; the node that
  goes is the last rank's, its torchrun and ranks SIGKILLed at once (rank 0's node hosts the store
  the workers meet at, and the one torchrun started first the rendezvous's: torchrun's job cannot
  outlive either); the spare's torchrun is
  started at the moment of the kill (as good as a replacement can be: no detection of its own),
  and the survivor's agent restarts its ranks when its collectives break.
"""

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from agent.confinement.cgroups import agent_cgroup_name
from ett.protocol import JobEnv
from recovery import (TORCHRUN, baseline_service_events, finished_job_report, read_spool, trainer_flags,
                      watch_torchrun_log)
from service.accounting.engine import Event
from service.accounting.memory import MemoryJob
from tests.support.cluster import cluster, events, trainer_job
from tests.support.postgres import free_port
from tests.support.processes import pids_in_cgroups_of, pids_with_env
from tests.support.waiting import wait_for

DEFAULT_HEARTBEATS = {"heartbeat_interval_seconds": "3", "heartbeat_wait_seconds": "3"}  # agent/settings.py's


def run_ett(args, root: Path) -> tuple[dict, list[Event]]:
    spec = trainer_job(
        "bench-node-loss", nodes=2, procs_per_node=args.procs, max_restarts=1, hang_timeout_seconds=120,
        trainer={"preset": args.preset, "overrides": trainer_flags(args)},
        checkpoint={"interval_steps": args.interval, "keep": 3, "snapshots": args.snapshots},
    )  # fmt: skip
    root.mkdir(parents=True)
    with cluster(root) as c:
        for name in ("node-0", "node-1", "node-2"):
            c.start_agent(name, slots=args.procs, wait=False, **DEFAULT_HEARTBEATS)
        for name in ("node-0", "node-1", "node-2"):
            c.wait_registered(name)
        job_id = c.submit(**spec)
        kill_at = args.kill_steps[0]
        wait_for(lambda: any(e.step >= kill_at for e in events(c, job_id, "step") if e.attempt == 0), 600,
                 f"step {kill_at}")  # fmt: skip
        victim = c.job(job_id)["attempts"][0]["nodes"][1]
        doomed = {c.agents[victim].pid, *pids_in_cgroups_of(agent_cgroup_name(victim, c.root / victim)),
                  *pids_with_env(JobEnv.CHECKPOINT_LOCAL_DIR, str(c.root / victim / "checkpoints" / job_id))}
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return finished_job_report(c, job_id)


class TorchrunNode:
    """One node's `torchrun` agent, its own process group, its stderr watched for failure marks."""

    def __init__(self, args, root: Path, name: str, port: int, attempt_offset: int) -> None:
        flags = {**trainer_flags(args), "checkpoint.dir": str(root / "checkpoints"),
                 "checkpoint.interval_steps": str(args.interval)}  # fmt: skip
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(args.procs), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench-node-loss", "--max-restarts", "1",
               str(Path(__file__).with_name("baseline_train.py")), "--preset", args.preset,
               *[x for k, v in flags.items() for x in (f"--{k}", v)]]  # fmt: skip
        # The spare's torchrun counts its restarts from 0; the attempt it joins is the survivor's 1.
        env = {**os.environ, "ETT_EVENT_DIR": str(root / "spool"), "LOGLEVEL": "INFO",
               "BENCH_ATTEMPT_OFFSET": str(attempt_offset),
               # torch 2.13: with the rendezvous's store shared with the workers (the default), a node
               # that joins a later round waits for the MASTER_ADDR rank 0 published only in its first
               # (dynamic_rendezvous.py keeps its bootstrap info): the spare never starts. Not shared,
               # each round publishes its own.
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
        self.marks: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)  # fmt: skip
        self._reader = threading.Thread(target=watch_torchrun_log, args=(self.proc.stderr, root / f"{name}.log", self.marks))
        self._reader.start()

    def lose(self) -> None:
        """The node goes: its torchrun and its workers (each in a session of its own) at once."""
        doomed = [self.proc.pid, *children_of(self.proc.pid)]
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def end(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self._reader.join()
        return rc


def run_baseline(args, root: Path) -> tuple[dict, list[Event]]:
    root.mkdir(parents=True)
    spool, port = root / "spool", free_port()
    launched = time.time()
    first = TorchrunNode(args, root, "node-0", port, 0)  # first: it holds the c10d store
    wait_for(lambda: _listening(port), 120, "the first torchrun's c10d store")
    nodes = [first, TorchrunNode(args, root, "node-1", port, 0)]
    try:
        kill_at = args.kill_steps[0]
        wait_for(lambda: any(e["kind"] == "step" and e["attempt"] == 0 and e["step"] >= kill_at
                             for e in read_spool(spool / "rank-0.jsonl")), 600, f"step {kill_at}")  # fmt: skip
        # The node of the last rank goes: rank 0's node holds the store the workers meet at (torchrun
        # hosts it in that node's agent), so torchrun's job cannot outlive that node.
        [pid] = [e["data"]["pid"] for e in read_spool(spool / f"rank-{args.procs * 2 - 1}.jsonl")
                 if e["kind"] == "init_start" and e["attempt"] == 0]  # fmt: skip
        [victim] = [node for node in nodes if pid in children_of(node.proc.pid)]
        [survivor] = [node for node in nodes if node is not victim]
        victim.lose()
        nodes.append(TorchrunNode(args, root, "node-2", port, 1))  # the spare, at once
        rc = survivor.end(timeout=1800)
        finished = time.time()
        spare_rc = nodes[2].end(timeout=60)
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                os.killpg(node.proc.pid, signal.SIGKILL)
        victim.end(timeout=10)
    if rc != 0 or spare_rc != 0:
        raise SystemExit(f"baseline torchrun exited {rc} (survivor), {spare_rc} (spare); see {root}/node-*.log")
    found = [Event(e["kind"], e["ts"], e["attempt"], e["source"], e["seq"], e["step"], e["data"])
             for path in sorted(spool.glob("rank-*.jsonl")) for e in read_spool(path)]  # fmt: skip
    found += baseline_service_events(launched, finished, rc, survivor.marks)
    job = MemoryJob("baseline")
    job.ingest(found)
    return job.report(finished), found


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
