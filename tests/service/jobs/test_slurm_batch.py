"""The batch job a Slurm allocation runs (service/slurm/batch.py): sbatch's options from the job
spec, and a script bash accepts that starts one agent a node with the service's settings."""

import subprocess

import pytest
from pydantic import ValidationError

from service.settings import Settings
from service.slurm.batch import render_script, sbatch_options
from service.spec.job_spec import JobSpec
from tests.service.factories import job_spec


def test_sbatch_options_carry_the_slurm_section_and_leave_out_bad_nodes(tmp_path):
    spec = job_spec(nodes=4, slurm={"partition": "gpu", "account": "llm", "time_limit": "2-00:00:00",
                                    "options": ["--gpus-per-node=8", "--exclusive"]})  # fmt: skip
    options = sbatch_options(JobSpec.model_validate(spec), "0123456789abcdef", tmp_path, ["n3", "n7"])
    assert "--nodes=4" in options and "--ntasks-per-node=1" in options and "--no-requeue" in options
    assert ["--partition=gpu", "--account=llm", "--time=2-00:00:00", "--exclude=n3,n7"] == [
        o for o in options if o.startswith(("--partition", "--account", "--time", "--exclude"))]
    assert options[-2:] == ["--gpus-per-node=8", "--exclusive"]  # the job's own, last
    assert f"--output={tmp_path / 'slurm-%j.out'}" in options and "--job-name=ett-moe-test-01234567" in options


def test_the_batch_script_is_valid_bash_with_the_agents_settings(tmp_path):
    settings = Settings(data_dir=tmp_path, slurm_service_url="http://ett.internal:8000",
                        slurm_agent_command="/opt/ett/bin/ett agent",
                        slurm_agent_env={"ETT_AGENT_HEALTH_CHECK": "check 'gpu's"})  # fmt: skip
    script = render_script(settings, tmp_path, procs_per_node=8)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "export ETT_AGENT_SERVICE_URL=http://ett.internal:8000" in script
    assert "export ETT_AGENT_SLOTS=8" in script and f"ETT_AGENT_TOKEN_FILE={tmp_path / 'agent.token'}" in script
    assert "export ETT_AGENT_HEALTH_CHECK='check '\"'\"'gpu'\"'\"'s'" in script  # quoted for the shell
    assert "ett-agent /opt/ett/bin/ett agent" in script


def test_slurm_agent_env_takes_agent_settings_only():
    with pytest.raises(ValidationError, match="ETT_SLURM_AGENT_ENV"):
        Settings(slurm_agent_env={"LD_PRELOAD": "/tmp/x.so"})


@pytest.mark.parametrize("name", ["ETT_AGENT_TOKEN", "ETT_AGENT_TOKEN_FILE", "ETT_AGENT_JOB_USER",
                                  "ETT_AGENT_ALLOW_ROOT_JOBS"])
def test_slurm_agent_env_cannot_hand_the_agents_a_token_or_one_user_for_every_owner(name):
    """A token there would be in the batch script, which Slurm keeps and shows; one job user would
    put every owner's jobs in one account (docs/slurm.md, "Who runs what")."""
    with pytest.raises(ValidationError, match=f"ETT_SLURM_AGENT_ENV: {name}: "):
        Settings(slurm_agent_env={name: "x"})
