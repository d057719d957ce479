"""The agent checks a job's checkpoint folder again at each launch (agent/confinement/confine.py): a folder
that resolves outside the job's area, or outside the agent's checkpoint root, and a resume point
outside the folder, are refused; the refusal is a configuration error (not retried) and starts
no process."""

import os
from pathlib import Path

from agent.confinement.confine import launch_refusal
from agent.groups.supervisor import Supervisor
from ett.protocol.messages import Fault
from tests.agent.helpers import launch_command, run_to_end
from tests.support.processes import pids_with_env


def command_with(area: Path, folder: Path, resume_from: Path | None = None):
    checkpoint = {"dir": str(folder), "area": str(area), "interval_steps": 5, "keep": 2,
                  "resume_from": str(resume_from) if resume_from else None}  # fmt: skip
    return launch_command("--steps", "2", checkpoint=checkpoint)


def test_a_folder_inside_its_area_may_launch(tmp_path):
    area = tmp_path / "root" / "alice"
    assert launch_refusal(command_with(area, area / "job", area / "job" / "step-00000005"), tmp_path / "root") is None


def test_a_link_laid_after_submit_is_caught_at_launch(tmp_path):
    area = tmp_path / "root" / "alice"
    area.mkdir(parents=True)
    os.symlink("/etc", area / "job")  # the service resolved <area>/job when it did not exist yet
    refusal = launch_refusal(command_with(area, area / "job"), None)
    assert refusal.startswith(f"refused: checkpoint.dir {area / 'job'} resolves to /etc, outside the job's")


def test_outside_the_agents_root_or_a_resume_point_elsewhere_is_refused(tmp_path):
    area = tmp_path / "elsewhere" / "alice"
    assert "outside this agent's checkpoint root" in launch_refusal(command_with(area, area / "j"), tmp_path / "root")
    area = tmp_path / "root" / "alice"
    other_job = area / "other" / "step-00000005"  # another job's checkpoint: never read, never pruned
    refusal = launch_refusal(command_with(area, area / "j", other_job), tmp_path / "root")
    assert "checkpoint.resume_from" in refusal and "outside the job's checkpoint.dir" in refusal


def test_a_refused_launch_runs_nothing_and_is_not_retried(tmp_path):
    supervisor = Supervisor(tmp_path / "spool", "node-a", stop_grace_seconds=1.0, checkpoint_root=tmp_path / "root")
    command = command_with(tmp_path / "root" / "alice", Path("/etc/ett-probe"))
    supervisor.launch(command)
    assert not supervisor.groups  # no group, no torchrun
    [report] = supervisor.reports.snapshot()
    assert (report.state, report.cause, report.exit_code) == ("failed", "exit", 3)
    assert report.detail.startswith("refused: checkpoint.dir /etc/ett-probe")
    assert pids_with_env("ETT_JOB_ID", command.job_id) == []
    assert not Path("/etc/ett-probe").exists()
    supervisor.reports.acknowledge(supervisor.reports.snapshot())
    ok = command_with(tmp_path / "root" / "alice", tmp_path / "root" / "alice" / "job")
    supervisor.launch(ok)  # the same agent runs a job whose folder is where it should be
    assert run_to_end(supervisor)["state"] == "succeeded"
    supervisor.shutdown()


def test_a_node_loss_drill_runs_only_where_the_agent_allows_it(tmp_path):
    area = tmp_path / "root" / "alice"
    command = command_with(area, area / "job").model_copy(
        update={"faults": [Fault(attempt=0, rank=0, at_step=3, action="lose_node")]})
    refusal = launch_refusal(command, tmp_path / "root")
    assert refusal == ("refused: faults: lose_node ends this agent and every job on its node; it runs only on "
                       "agents started with ETT_AGENT_NODE_LOSS_DRILLS=true")
    assert launch_refusal(command, tmp_path / "root", node_loss_drills=True) is None
