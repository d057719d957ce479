"""A lost node loses at most one step (#38): the real service, three real agents (two for the job,
a spare), the plain DDP example under torchrun with per-step snapshots replicated to the peer
node. The agent of one node, its ranks and its node-local folder go at once; the job resumes on
the spare from the peers' copies and ends bitwise equal to the same script run uninterrupted."""

import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent.cgroups import agent_cgroup_name
from ett.protocol import JobEnv
from ett.snapshot_folder import SnapshotFolder, snapshots_root
from tests.e2e.test_own_scripts import assert_same_parameters, plain_torchrun
from tests.support.cluster import assert_categories_sum_to_wall, cluster, events, example_job
from tests.support.processes import pids_in_cgroups_of, pids_with_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow


def test_a_lost_node_resumes_on_the_spare_from_its_peers_copies_losing_at_most_a_step(tmp_path):
    plain, as_job = tmp_path / "plain.pt", tmp_path / "ett.pt"
    spec = example_job("plain_ddp.toml")
    spec["entrypoint"] = [*spec["entrypoint"], "--out", str(as_job)]
    spec["checkpoint"] = {**spec["checkpoint"], "interval_steps": 20, "snapshots": True}  # persistent: step 20 only
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(plain_torchrun, "plain_ddp.py", "--steps", "40", "--checkpoint-dir",
                                    str(tmp_path / "plain"), "--out", str(plain))
        with cluster(tmp_path, heartbeat_timeout_seconds=5) as c:
            c.start_agents("node-a", "node-b", "node-c")
            job_id = c.submit(**spec)
            wait_for(lambda: len(c.job(job_id)["attempts"]) == 1 and c.job(job_id)["attempts"][0]["nodes"], 60,
                     "the first attempt's nodes")
            survivor, victim = c.job(job_id)["attempts"][0]["nodes"]
            local = {name: c.root / name / "checkpoints" / job_id for name in (survivor, victim)}
            copies = SnapshotFolder(snapshots_root(local[survivor], 2))  # what the survivor keeps of rank 1

            def replicated() -> int:  # the newest step of rank 1 whose copy is on the survivor's disk
                steps = copies.steps(1)
                return steps[0] if steps and steps[0] >= 10 else 0

            replicated_step = wait_for(replicated, 120, "rank 1's snapshot of step 10 or later on its peer")
            # The node goes at once: its agent, its ranks (and their torchrun), its disk.
            ranks = set(pids_with_env(JobEnv.CHECKPOINT_LOCAL_DIR, str(local[victim])))
            ranks |= set(pids_in_cgroups_of(agent_cgroup_name(victim, c.root / victim)))
            for pid in [c.agents[victim].pid, *ranks]:
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(local[victim])
            assert ranks, "the lost node's ranks were not found"

            job = c.wait_job(job_id, timeout=300)
            assert job["state"] == "succeeded", c.logs()
            first, second = job["attempts"]
            # The survivor's ranks fail first (their collectives break); the loss, known once the
            # heartbeats are overdue, is the root cause.
            assert first["cause"] == "node_lost", first
            assert victim not in second["nodes"] and survivor in second["nodes"]
            restores = {e.source: e for e in events(c, job_id, "restore_end") if e.attempt == 1}
            spare_rank = f"rank:{second['nodes'].index('node-c')}"
            survivor_rank = f"rank:{second['nodes'].index(survivor)}"
            resumed = restores[spare_rank].step
            assert restores[survivor_rank].step == resumed >= replicated_step
            assert restores[spare_rank].data["source"] == "peer-snapshot"
            assert restores[survivor_rank].data["source"] == "local-snapshot"
            last_of_first = max(e.step for e in events(c, job_id, "step") if e.attempt == 0)
            report = c.report(job_id)
            [failure] = report["failures"]
            assert failure["lost_steps"] == last_of_first - resumed <= 1, (failure, resumed, last_of_first)
            assert_categories_sum_to_wall(report)
        uninterrupted.result()
    assert_same_parameters(plain, as_job)
