"""The torchrun command line, environment and settings an agent builds (no processes here)."""

import argparse
import subprocess
import sys

import httpx
import pytest
from prometheus_client import CollectorRegistry

from agent import cli
from agent.confinement.procs import GROUP_MARKER_ENV
from agent.files.spool import AttemptPaths
from agent.launching.launch import lean_main, torchrun_argv, worker_env
from agent.node.metrics import AgentStats, serve_metrics
from agent.settings import AgentSettings
from tests.agent.helpers import free_port, launch_command


def trainer_command(**fields):
    return launch_command(entrypoint=None, trainer={"preset": "cpu-demo", "overrides": {
        "moe.num_experts": 8, "optim.lr": 0.001, "parallel.compile": True, "data.name": "tiny"}}, **fields)


def test_trainer_argv_under_torchrun_with_the_rank_runner(tmp_path):
    command = trainer_command(nnodes=2, node_rank=1, master_port=29517, checkpoint={
        "interval_steps": 50, "keep": 3, "dir": "/ckpt/j", "local_dir": "/nvme/j", "resume_from": "/ckpt/j/step-00000040"})
    paths = AttemptPaths.of(tmp_path, command.job_id, 0)
    argv = torchrun_argv(command, paths)

    boot = lean_main(sys.executable, "agent.launching.rank_runner")
    runner = next(i for i in range(len(argv)) if argv[i:i + len(boot)] == boot) + len(boot) - 1
    torchrun = argv[argv.index("torch.distributed.run") + 1: runner - len(boot) + 1]
    assert torchrun == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                        "--master-port", "29517", "--max-restarts", "0", "--no-python"]
    rank = argv[argv.index("--", runner) + 1:]
    assert rank == [sys.executable, "-P", "-m", "trainer.train", "--preset", "cpu-demo", "--moe.num_experts", "8",
                    "--optim.lr", "0.001", "--parallel.compile", "true", "--data.name", "tiny",
                    "--checkpoint.dir", "/ckpt/j", "--checkpoint.local_dir", "/nvme/j",
                    "--checkpoint.interval_steps", "50", "--checkpoint.keep", "3",
                    "--checkpoint.resume_from", "/ckpt/j/step-00000040"]


def test_only_the_nodes_but_the_master_wait_for_its_store(tmp_path):
    def guard_options(node_rank: int) -> list[str]:
        argv = torchrun_argv(trainer_command(nnodes=2, node_rank=node_rank, master_port=29517),
                             AttemptPaths.of(tmp_path, "j", 0))
        boot = lean_main(sys.executable, "agent.launching.guard")
        assert argv[:len(boot)] == boot
        return argv[len(boot) + 1: argv.index("--")]  # after the agent's pid

    assert guard_options(0) == []
    assert guard_options(1) == ["--wait-for", "127.0.0.1:29517"]


@pytest.mark.parametrize("module", ["agent.launching.guard", "agent.launching.rank_runner"])
def test_the_guard_and_the_rank_runner_start_without_site_and_say_their_usage(module):
    # lean_main's boot finds our packages without `site` (what they import: test_guard.py), and each says
    # its usage for a command line it cannot take, in one line with no traceback.
    refused = subprocess.run(lean_main(sys.executable, module), capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and refused.stderr.startswith("usage: "), refused.stderr
    assert "Traceback" not in refused.stderr
    assert lean_main(sys.executable, module)[1] == "-S"
    # Another interpreter (job_python) has ett installed its own way: found by its site, as a module.
    assert lean_main("/opt/other/bin/python", module) == ["/opt/other/bin/python", "-P", "-m", module]


def test_no_resume_point_named_means_the_newest_that_verifies(tmp_path):
    argv = torchrun_argv(trainer_command(), AttemptPaths.of(tmp_path, "j", 0))
    assert argv[-2:] == ["--checkpoint.resume_from", "auto"]


def test_worker_env_adds_the_spool_and_ids_and_hides_the_agent_token(tmp_path, monkeypatch):
    monkeypatch.setenv("ETT_AGENT_TOKEN", "secret")
    command = launch_command(attempt=3, env={"NCCL_DEBUG": "INFO", "ETT_EVENT_DIR": "/elsewhere"})
    paths = AttemptPaths.of(tmp_path, command.job_id, 3)
    env = worker_env(command, paths, "marker-1")

    assert env["NCCL_DEBUG"] == "INFO"
    assert (env["ETT_EVENT_DIR"], env["ETT_JOB_ID"], env["ETT_ATTEMPT"]) == (str(paths.events_dir), command.job_id, "3")
    assert env[GROUP_MARKER_ENV] == "marker-1"
    assert "ETT_AGENT_TOKEN" not in env


def test_a_bad_setting_stops_the_agent_naming_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ETT_AGENT_TOKEN", "t")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)

    assert cli.main(parser.parse_args(["--slots", "0", "--data-dir", str(tmp_path)])) == 2
    assert "bad setting ETT_AGENT_SLOTS" in capsys.readouterr().err


def test_the_agent_token_comes_from_a_file_or_the_environment_never_a_flag(capsys, monkeypatch, tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    # `ps` would show a token on the command line to every user of the node: there is no such flag.
    flag = subprocess.run([sys.executable, "-m", "ett_cli.main", "agent", "--token", "ett_secret"],
                          capture_output=True, text=True, timeout=60)
    assert flag.returncode == 2 and "unrecognized arguments: --token" in flag.stderr
    monkeypatch.delenv("ETT_AGENT_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("ett_from_file\n")
    assert AgentSettings(token_file=token_file).token == "ett_from_file"

    def refusal(*argv: str) -> str:
        assert cli.main(parser.parse_args([*argv, "--data-dir", str(tmp_path)])) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        return line

    assert refusal() == "ett agent: no agent token: set ETT_AGENT_TOKEN_FILE (a file holding it) or ETT_AGENT_TOKEN"
    assert refusal("--token-file", str(tmp_path / "missing")) == (
        f"ett agent: ETT_AGENT_TOKEN_FILE {tmp_path / 'missing'}: No such file or directory")
    monkeypatch.setenv("ETT_AGENT_TOKEN", "ett_env")
    assert refusal("--token-file", str(token_file)) == (
        "ett agent: set one of ETT_AGENT_TOKEN and ETT_AGENT_TOKEN_FILE, not both")


def test_metrics_endpoint_serves_the_heartbeat_figures():
    stats = AgentStats(processes=2, events_forwarded=10, dead_letters=1, spool_bytes=1234, rank_events_unwritten=5,
                       rank_events_dropped=2)  # fmt: skip
    port = free_port()
    server = serve_metrics(stats, port, CollectorRegistry())
    stats.events_forwarded = 11  # read at scrape time
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        server.shutdown()
    assert "ett_agent_processes 2.0" in text
    assert "ett_agent_events_forwarded_total 11.0" in text
    assert "ett_agent_dead_letters_total 1.0" in text
    assert "ett_agent_spool_bytes 1234.0" in text
    assert "ett_agent_rank_events_unwritten 5.0" in text and "ett_agent_rank_events_dropped 2.0" in text
    assert stats.heartbeat_figures()["rank_events_unwritten"] == 5  # the heartbeat carries the same
