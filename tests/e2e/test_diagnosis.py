"""Failures diagnosed from the evidence, with real agents and torchrun ranks: an exception gives
`exception` and its line, a memory hog under a memory cap `out_of_memory`, a missing module ends the
job at its first attempt, and a job that fails the same way at the same step stops restarting. The
library's injected faults (raise, fill_memory, fill_disk) fail a script on ett the same ways."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ett.protocol import LOG_FILE
from tests.agent.helpers import ETT_RANK
from tests.support.cluster import cluster

pytestmark = pytest.mark.slow
EXCEPTION = "raise ValueError('bad batch')"
MEMORY_HOG = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # the rank's memory cap: 1 GiB
hog = bytearray(2 << 30)
"""
STUCK_AT_12 = """
for step in range(1, 100):
    print(f"step {step}", flush=True)
    if step == 12:
        raise RuntimeError("NaN loss at step 12")
"""
MISSING_MODULE = "import no_such_module_anywhere"
# A script as users write one: its process group up, then a bad batch at step 5 on rank 0. torch
# then prints the traceback as `[rank0]: ValueError: bad batch`, which the diagnosis sees through.
IN_A_PROCESS_GROUP = """
import time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
for step in range(1, 11):
    dist.all_reduce(torch.ones(1))
    if step == 5 and dist.get_rank() == 0:
        raise ValueError("bad batch")
    time.sleep(0.05)
dist.destroy_process_group()
"""


def job(name: str, code: str, **spec):
    return {"name": name, "nodes": 1, "procs_per_node": 1, "hang_timeout_seconds": None,
            "entrypoint": [sys.executable, "-c", code]} | spec


def test_failures_are_diagnosed_from_the_ranks_output_and_hopeless_restarts_stop(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agent("node-a")
        exception = c.wait_job(c.submit(**job("exception", EXCEPTION, max_restarts=0)))
        hog = c.wait_job(c.submit(**job("hog", MEMORY_HOG, max_restarts=0)))
        for done, kind, summary in ((exception, "exception", "ValueError: bad batch"),
                                    (hog, "out_of_memory", "MemoryError")):
            [failure] = c.report(done["id"])["failures"]
            assert (failure["diagnosis"], failure["summary"]) == (kind, summary), failure

        grouped = c.wait_job(c.submit(**job("grouped", IN_A_PROCESS_GROUP, max_restarts=0, procs_per_node=2)))
        [attempt] = grouped["attempts"]
        assert (attempt["diagnosis"], attempt["summary"]) == ("exception", "ValueError: bad batch"), attempt
        env = os.environ | {"ETT_SERVICE_URL": c.service.url, "ETT_TOKEN": c.service.token("user", "alice")}
        told = subprocess.run([sys.executable, "-m", "ett_cli.main", "report", grouped["id"]], env=env,
                              capture_output=True, text=True, timeout=60)
        assert told.returncode == 0 and "exception" in told.stdout and "ValueError: bad batch" in told.stdout, told

        missing = c.wait_job(c.submit(**job("missing", MISSING_MODULE, max_restarts=5)))
        assert missing["state"] == "failed" and len(missing["attempts"]) == 1
        assert missing["reason"] == ("import_error, not retried: ModuleNotFoundError: No module named "
                                     "'no_such_module_anywhere'")

        stuck = c.wait_job(c.submit(**job("stuck", STUCK_AT_12, max_restarts=10)))
        assert stuck["state"] == "failed" and len(stuck["attempts"]) == 3, stuck
        assert stuck["reason"].startswith("the same failure 3 times in a row, with no progress past it"), stuck
        assert stuck["reason"].endswith("exception: RuntimeError: NaN loss at step 12; not restarted again "
                                        "(max_same_failures)")

        fleet = c.user.get("/api/v1/ett").json()
        assert fleet["failure_diagnoses"] == {"exception": 5, "import_error": 1, "out_of_memory": 1}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small file system")
@pytest.mark.over_budget("three drills, each a job of its own from a fresh interpreter")
def test_injected_faults_fail_a_script_on_the_library_as_real_ones_would(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        with cluster(tmp_path) as c:
            c.start_agent("node-a")
            script = [sys.executable, str(ETT_RANK), "--steps", "5"]

            def drill(name: str, fault: dict, argv: list[str] = script) -> dict:
                spec = {"name": name, "nodes": 1, "procs_per_node": 1, "max_restarts": 0, "entrypoint": argv,
                        "faults": [{"attempt": 0, "rank": 0, "at_step": 3} | fault]}
                job = c.wait_job(c.submit(**spec))
                assert job["state"] == "failed", job
                [failure] = c.report(job["id"])["failures"]
                return failure

            def evidence(failure: dict) -> tuple:
                """What each side saw (once in CI the disk drill ended "torchrun exit code 1" with no rank
                record, and the memory drill's rank log was read before its last lines were in it)."""
                torchrun_logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}"
                                           for p in (tmp_path / "node-a").rglob(LOG_FILE))
                return failure, c.logs(), torchrun_logs

            raised = drill("raise", {"action": "raise", "exception": "ValueError", "message": "bad batch"})
            assert (raised["diagnosis"], raised["summary"]) == ("exception", "ValueError: bad batch")
            capped = ["prlimit", "--as=3000000000", *script]  # the rank's memory cap: 3 GB of address space
            memory = drill("memory", {"action": "fill_memory"}, capped)
            assert (memory["diagnosis"], memory["summary"]) == ("out_of_memory", "MemoryError"), evidence(memory)
            full = drill("disk", {"action": "fill_disk", "path": str(small)})
            assert full["diagnosis"] == "disk_full" and "No space left on device" in full["summary"], evidence(full)
    finally:
        subprocess.run(["umount", str(small)], check=False)


MEMORY_CGROUP = Path("/sys/fs/cgroup/memory")
OOM_HOG = "h = []\nwhile True:\n    h.append(bytearray(16 << 20)); h[-1][::4096] = b'x' * (4 << 10)"


@pytest.mark.skipif(os.geteuid() != 0 or not MEMORY_CGROUP.is_dir(), reason="a v1 memory cgroup to cap a rank")
def test_a_rank_the_kernels_out_of_memory_killer_ends_is_diagnosed_so(tmp_path):
    """No traceback, only SIGKILL: the agent reads the kernel's log for the kill of that rank, and, the
    limit being the operator's, counts the kill as node evidence."""
    cap = MEMORY_CGROUP / f"ett-test-{os.getpid()}"
    cap.mkdir()
    try:
        (cap / "memory.limit_in_bytes").write_text(str(1536 << 20))
        with cluster(tmp_path) as c:
            # Capped before its first line: its warm server, and the torchrun it forks, are capped too.
            agent = c.start_agent("node-a", wait=False)
            (cap / "cgroup.procs").write_text(str(agent.pid))
            c.wait_registered("node-a")
            killed = c.wait_job(c.submit(**job("oom", OOM_HOG, max_restarts=0)))
            [failure] = c.report(killed["id"])["failures"]
            [node] = c.admin.get("/api/v1/nodes").json()
        # The cap is the operator's, over the agent, not the job's own: the kernel's record of the kill is
        # node evidence, read by the agent (service/agents/node_evidence.py).
        assert any(e["kind"] == "oom_kill" and e["job_id"] == killed["id"] and f"oom_memcg=/{cap.name}," in e["detail"]
                   for e in node["evidence"]), node
        assert failure["cause"] == "signal" and failure["diagnosis"] == "out_of_memory", failure
        assert "killed by SIGKILL: the kernel's out-of-memory killer (Memory cgroup out of memory: Killed process" in (
            failure["summary"]), failure
    finally:
        for pid in (cap / "cgroup.procs").read_text().split():  # the agent and what is left of its processes
            with contextlib.suppress(OSError):
                (MEMORY_CGROUP / "cgroup.procs").write_text(pid)
        cap.rmdir()
