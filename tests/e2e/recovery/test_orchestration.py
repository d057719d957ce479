"""End to end: the real service, real agent daemons, real torchrun ranks training the MoE on CPU."""

import os
import signal

import pytest
from sqlalchemy import select

from agent.confinement.cgroups import agent_cgroup_name
from service.models import Node, NodeState
from tests.support.cluster import (
    assert_categories_sum_to_wall,
    cluster,
    events,
    named_checkpoint_step,
    trainer_job,
)
from tests.support.processes import pid_alive, pids_in_cgroups_of, pids_with_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow


def test_sigkill_of_a_rank_resumes_from_the_last_committed_checkpoint(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agent("node-a"), c.start_agent("node-b")
        job_id = c.submit(**trainer_job(faults=[{"attempt": 0, "rank": 1, "at_step": 13, "action": "kill"}]))
        job = c.wait_job(job_id)
        assert job["state"] == "succeeded", c.logs()
        first, second = c.attempts(job, 2)
        assert first["cause"] == "signal" and second["state"] == "succeeded"
        assert not c.agent_failures()  # every group ended in the agent too (its warm servers spared)

        newest = named_checkpoint_step(c, job_id)
        assert second["resume_from"].endswith(f"step-{newest:08d}")
        [restore] = [e for e in events(c, job_id, "restore_end") if e.attempt == 1 and e.source == "rank:0"]
        assert restore.step == newest and second["restored_step"] == newest and first["restored_step"] is None
        # The job page says so too.
        page = c.user.get(f"/jobs/{job_id}").text
        assert f"step {newest} <span class=\"muted\">(newest checkpoint {second['resume_from']})</span>" in page
        # The same nodes with the same ranks: each rank reads its own shards from its node's local
        # copy (a few items another node's rank wrote come from the persistent folder: "mixed").
        sources = {e.source: e.data["source"] for e in events(c, job_id, "restore_end") if e.attempt == 1}
        assert len(sources) == 4 and set(sources.values()) <= {"local", "mixed"}, sources

        steps = events(c, job_id, "step")
        last_of_first = max(e.step for e in steps if e.attempt == 0)
        assert max(e.step for e in steps if e.attempt == 1) == 24
        report = c.report(job_id)
        [failure] = report["failures"]
        assert failure["cause"] == "signal" and failure["lost_steps"] == last_of_first - newest
        assert report["restarts"] == 1 and report["seconds"]["restore"] > 0
        assert_categories_sum_to_wall(report)


def test_hang_is_detected_and_recovered(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agent("node-a"), c.start_agent("node-b")
        spec = trainer_job(hang_timeout_seconds=8, faults=[{"attempt": 0, "rank": 2, "at_step": 8, "action": "hang"}])
        job = c.wait_job(c.submit(**spec))
        assert job["state"] == "succeeded", c.logs()
        assert [a["cause"] for a in job["attempts"]] == ["hang", None]
        assert_categories_sum_to_wall(c.report(job["id"]))


def test_killed_agent_is_replaced_by_a_spare(tmp_path):
    with cluster(tmp_path, heartbeat_timeout_seconds=5) as c:
        for name in ("node-a", "node-b", "node-c"):
            c.start_agent(name)
        job_id = c.submit(**trainer_job(checkpoint={"interval_steps": 5, "keep": 3, "snapshots": True}))
        wait_for(lambda: events(c, job_id, "ckpt_committed"), 180, "a committed checkpoint")
        victim = c.job(job_id)["attempts"][0]["nodes"][1]
        ranks = pids_in_cgroups_of(agent_cgroup_name(victim, c.root / victim))  # guard, torchrun, runners, ranks
        assert len(ranks) >= 4 or os.geteuid() != 0, ranks
        os.kill(c.agents[victim].pid, signal.SIGKILL)  # no goodbye: only missing heartbeats tell
        def lost() -> bool:
            with c.service.context.sessions() as session:
                return session.scalar(select(Node.state).where(Node.name == victim)) == NodeState.lost
        wait_for(lost, 60, "the killed node to be declared lost")
        # By then nothing of its attempt is alive: its guard emptied the attempt's cgroup.
        assert not [pid for pid in ranks if pid_alive(pid)], ranks
        job = c.wait_job(job_id)
        assert job["state"] == "succeeded", c.logs()
        first, second = c.attempts(job, 2)
        # Its peers' collectives usually fail first ("exit"); the silent node is declared lost after.
        assert first["cause"] in ("exit", "node_lost")
        assert victim not in second["nodes"] and len(second["nodes"]) == 2
        # The spare's disk holds nothing of the job: its ranks (EP 2, ZeRO-3 shards) take their state
        # from the copies the survivor's ranks kept of the lost node's snapshots, unless the checkpoint
        # the service named is of the same step (it wins a tie).
        spare_ranks = {f"rank:{2 * second['nodes'].index('node-c') + i}" for i in (0, 1)}
        restores = {e.source: e for e in events(c, job_id, "restore_end") if e.attempt == 1}
        sources = {rank: e.data["source"] for rank, e in restores.items()}
        assert len(sources) == 4 and len({e.step for e in restores.values()}) == 1, sources
        if restores["rank:0"].step > named_checkpoint_step(c, job_id):
            assert all(v == ("peer-snapshot" if k in spare_ranks else "local-snapshot") for k, v in sources.items())
        else:
            assert all((v == "persistent") == (k in spare_ranks) for k, v in sources.items()), sources
        last_of_first = max(e.step for e in events(c, job_id, "step") if e.attempt == 0)
        assert last_of_first - restores["rank:0"].step <= 1  # a lost node loses at most a step
        with c.service.context.sessions() as session:
            assert session.scalar(select(Node.state).where(Node.name == victim)) == NodeState.lost
        # Nothing of the job stays: not the killed node's ranks (its guard swept them), nor, after
        # their wind-down, the surviving nodes' guards and torchrun (a success is reported once the
        # ranks exit, before torchrun is done: seen here 1 run in 3 on a loaded machine).
        wait_for(lambda: not pids_with_env("ETT_JOB_ID", job_id), 30, "the job's processes to end")


def test_configuration_error_fails_without_retry(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agent("node-a")
        spec = trainer_job(nodes=1, procs_per_node=1, trainer={"preset": "tiny", "overrides": {"moe.top_k": 99}})
        job = c.wait_job(c.submit(**spec))
        assert job["state"] == "failed" and len(job["attempts"]) == 1
        assert "configuration error" in job["reason"]


def test_an_agent_started_beside_folders_named_like_our_packages_runs_the_installed_ones(tmp_path):
    shadows = tmp_path / "workdir"
    for package in ("agent", "trainer", "ett"):  # `python -m` would import these from the working folder
        (shadows / package).mkdir(parents=True)
        (shadows / package / "__init__.py").write_text(f"raise ImportError('{package} of the working folder')\n")
    with cluster(tmp_path) as c:
        c.start_agent("node-a", cwd=shadows)
        spec = trainer_job(nodes=1, procs_per_node=2, trainer={"preset": "tiny", "overrides": {"train.steps": 4}})
        job = c.wait_job(c.submit(**spec))
        assert job["state"] == "succeeded", c.logs()


def test_an_auto_interval_changes_in_the_running_attempt(tmp_path):
    # No failure anywhere yet: the assumed MTBF (20 s) stands in for the failure rate. Young's
    # interval from the first save's cost is far from the default 50 steps: the ranks are told.
    with cluster(tmp_path, assumed_mtbf_seconds=20) as c:
        c.start_agent("node-a")
        spec = trainer_job(nodes=1, procs_per_node=2, trainer={"preset": "tiny", "overrides": {"train.steps": 200}},
                           checkpoint={"interval_steps": "auto", "keep": 3})
        job_id = c.submit(**spec)
        job = c.wait_job(job_id)
        assert job["state"] == "succeeded" and len(job["attempts"]) == 1, c.logs()
        retunes = sorted((e for e in events(c, job_id, "checkpoint_interval") if e.attempt == 0),
                         key=lambda e: e.data["from_step"])
        committed = sorted({e.step for e in events(c, job_id, "ckpt_committed")})
    first = retunes[0].data
    assert first["was"] == 50 and first["interval_steps"] != 50, retunes
    # The default until the switch, the new interval from it on, with no restart in between. The
    # service may retune again as it measures more saves: each interval holds from its own step.
    assert [s for s in committed if s < first["from_step"]] == list(range(50, first["from_step"], 50))
    later = [s for s in committed if first["from_step"] <= s < 200]

    def interval_at(step: int) -> int:
        return [e.data["interval_steps"] for e in retunes if e.data["from_step"] <= step][-1]

    assert later and all(s % interval_at(s) == 0 for s in later) and committed[-1] == 200, (
        committed, [e.data for e in retunes])


def test_max_restarts_is_honoured(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agent("node-a")
        faults = [{"attempt": n, "rank": 0, "at_step": 2, "action": "exit", "code": 7} for n in range(3)]
        spec = trainer_job(nodes=1, procs_per_node=1, max_restarts=1, faults=faults, trainer={"preset": "tiny"})
        job = c.wait_job(c.submit(**spec))
        assert job["state"] == "failed" and len(job["attempts"]) == 2, c.logs()
        assert all(a["cause"] == "exit" for a in job["attempts"])


def test_cancel_leaves_no_process(tmp_path):
    with cluster(tmp_path) as c:
        c.start_agent("node-a")
        spec = trainer_job(nodes=1, trainer={"preset": "tiny", "overrides": {"train.steps": 100000}})
        job_id = c.submit(**spec)
        wait_for(lambda: events(c, job_id, "step"), 120, "a first step")
        assert pids_with_env("ETT_JOB_ID", job_id)
        assert c.user.post(f"/api/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        wait_for(lambda: not pids_with_env("ETT_JOB_ID", job_id), 30, "every process of the job to end")
        assert c.job(job_id)["attempts"][0]["state"] == "stopped"
