"""Worker groups under real torchrun, with the fake rank: every way an attempt can end."""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agent.confinement.cgroup_end import remove_when_released
from agent.confinement.uid_sweep import parent_pid
from agent.files.spool import AttemptPaths
from agent.groups.supervisor import Supervisor
from agent.warm.servers import WarmServers
from ett.protocol import (
    FROZEN_SECONDS,
    INTERVAL_FILE,
    PROGRESS_GLOB,
    STOPPED_SECONDS,
    progress_file,
    rank_log,
    rank_spool,
)
from ett.protocol.messages import IntervalCommand
from tests.agent.helpers import ETT_RANK, free_port, launch_command, read_events, run_to_end
from tests.conftest import WORKER_ENV
from tests.support.processes import TEST_MARK_ENV, pid_alive, pids_with_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow


def spool_events(supervisor, command, source):
    paths = AttemptPaths.of(supervisor.spool_root, command.job_id, command.attempt)
    if source.startswith("rank:"):
        return read_events(paths.events_dir / rank_spool(int(source.split(":")[1])))
    return read_events(paths.node_spool(source.removeprefix("node:")))


def test_success_reports_every_rank_and_the_spool_env(supervisor):
    command = launch_command("--steps", "3", attempt=2)
    supervisor.launch(command)
    report = run_to_end(supervisor)

    # Its `kernel` readings are the node's (agent/node/kernel_log.py): another test's real
    # out-of-memory kill on this machine may be among them, so they are not this test's to check.
    assert {k: v for k, v in report.items() if k != "kernel"} == {
        "job_id": command.job_id, "attempt": 2, "state": "succeeded", "cause": None, "detail": "", "exit_code": None,
        "imports": []}
    node_events = spool_events(supervisor, command, "node:node-a")
    assert [e["kind"] for e in node_events] == ["workers_launched", "worker_exited", "worker_exited"]
    assert [e["seq"] for e in node_events] == [0, 1, 2]
    assert sorted(e["data"]["rank"] for e in node_events[1:]) == [0, 1]
    assert all(e["data"]["exit_code"] == 0 and e["attempt"] == 2 for e in node_events[1:])
    steps = [e["step"] for e in spool_events(supervisor, command, "rank:0") if e["kind"] == "step"]
    assert steps == [1, 2, 3]
    assert spool_events(supervisor, command, "rank:1")[0]["attempt"] == 2  # ETT_ATTEMPT reached the rank


def test_a_torchrun_that_starts_no_rank_says_why_in_the_failure(supervisor):
    """Its master port held by another program on the node: torchrun's rendezvous fails before any
    rank starts, and the failure names torchrun's own last word, not only its exit code."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        command = launch_command("--steps", "3", nproc=1, master_port=held.getsockname()[1])
        supervisor.launch(command)
        report = run_to_end(supervisor)
    assert report["state"] == "failed" and report["detail"].startswith("torchrun exit code 1: "), report
    assert "EADDRINUSE" in report["detail"] and "torchrun.log" in report["detail"], report


def test_what_a_job_lays_in_its_events_folder_does_not_stop_the_monitor(supervisor):
    """A folder named like a spool and a line without end in the events folder: the agent's monitor
    goes on reading the ranks' records and progress, and the attempt ends as it should."""
    command = launch_command("--steps", "5", "--lay-traps")
    supervisor.launch(command)
    assert run_to_end(supervisor)["state"] == "succeeded"
    steps = [e["step"] for e in spool_events(supervisor, command, "rank:0") if e["kind"] == "step"]
    assert steps == [1, 2, 3, 4, 5]


def test_a_new_interval_is_never_written_or_read_through_a_link_the_job_laid(supervisor, tmp_path):
    """The agent (root) writes a running attempt's new checkpoint interval into the job's control
    folder: a link the job lays there, at the file, its staging name or the folder itself, is
    neither written through nor read, and the agent goes on."""
    command = launch_command("--steps", "100000")
    supervisor.launch(command)
    group = supervisor.groups[command.key]
    control = group.paths.control_dir
    interval = IntervalCommand(type="checkpoint_interval", job_id=command.job_id, attempt=0, interval_steps=9,
                               from_step=5)  # fmt: skip
    supervisor.set_interval(interval)
    assert (control / INTERVAL_FILE).read_text() == "9 5\n"  # the plain case

    probe, secret = tmp_path / "probe", tmp_path / "root-only"
    probe.write_text("untouched\n")
    secret.write_text("root:$6$secret-hash\n")
    secret.chmod(0o600)
    (control / f"{INTERVAL_FILE}.new").symlink_to(probe)  # the staging name: once written through
    supervisor.set_interval(interval.model_copy(update={"interval_steps": 11, "from_step": 7}))
    assert probe.read_text() == "untouched\n" and (control / INTERVAL_FILE).read_text() == "9 5\n11 7\n"

    (control / INTERVAL_FILE).unlink()
    (control / INTERVAL_FILE).symlink_to(secret)  # read, then copied where the job reads it
    supervisor.set_interval(interval)
    assert (control / INTERVAL_FILE).is_symlink() and secret.read_text() == "root:$6$secret-hash\n"
    assert not any("secret-hash" in p.read_text() for p in control.iterdir() if p.is_file() and not p.is_symlink())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    control.rename(control.with_name("moved"))
    control.symlink_to(elsewhere)  # the whole folder
    supervisor.set_interval(interval)
    assert list(elsewhere.iterdir()) == []
    supervisor.poll()  # the agent goes on
    assert command.key in supervisor.groups


def test_nonzero_exit_names_the_rank_and_code(supervisor):
    command = launch_command("--steps", "50", "--fail-rank", "1", "--fail-at-step", "2", "--fail-code", "7")
    supervisor.launch(command)
    report = run_to_end(supervisor)

    assert (report["state"], report["cause"], report["exit_code"]) == ("failed", "exit", 7)
    assert report["detail"] == "rank 1 exit code 7"
    exits = [e["data"] for e in spool_events(supervisor, command, "node:node-a") if e["kind"] == "worker_exited"]
    assert {"rank": 1, "exit_code": 7} in exits
    assert not pids_with_env("ETT_JOB_ID", command.job_id)


def test_killed_by_signal(supervisor):
    command = launch_command("--steps", "50", "--fail-rank", "0", "--fail-at-step", "2", "--fail-signal", "SIGKILL")
    supervisor.launch(command)
    report = run_to_end(supervisor)

    assert (report["state"], report["cause"], report["detail"]) == ("failed", "signal", "rank 0 killed by SIGKILL")
    exits = [e["data"] for e in spool_events(supervisor, command, "node:node-a") if e["kind"] == "worker_exited"]
    assert {"rank": 0, "signal": "SIGKILL"} in exits


def test_a_failure_is_reported_at_once_and_the_next_launch_waits_for_the_group_to_go(supervisor):
    # Rank 0 ignores the SIGTERM torchrun sends it when rank 1 fails: the group lingers until the grace's SIGKILL.
    command = launch_command("--steps", "100000", "--fail-rank", "1", "--fail-at-step", "2", "--ignore-sigterm")
    supervisor.launch(command)
    wait_for(lambda: supervisor.reports.snapshot()[0].state == "failed", 60, "the failure",
             while_waiting=supervisor.poll)
    assert command.key in supervisor.groups, "reported while its rank 0 still runs"
    assert supervisor.reports.snapshot()[0].detail == "rank 1 exit code 1"

    restart = launch_command("--steps", "2", job_id=command.job_id, attempt=1)
    supervisor.launch(restart)
    assert restart.key not in supervisor.groups  # held back
    wait_for(lambda: restart.key in supervisor.groups, 30, "the held launch to start", while_waiting=supervisor.poll)
    assert command.key not in supervisor.groups  # only once the failed group was gone
    wait_for(lambda: not supervisor.groups, 60, "the restart to end", while_waiting=supervisor.poll)
    assert {r.attempt: r.state for r in supervisor.reports.snapshot()} == {0: "failed", 1: "succeeded"}


LAST_WORDS_AND_A_CHILD = """
import subprocess, sys
child = subprocess.Popen(["sleep", "120"])  # it holds the rank's output pipe
print(f"child {child.pid}", flush=True)
print("MemoryError: the last words", flush=True)
sys.exit(1)
"""


def test_a_failure_is_reported_once_the_ranks_last_words_are_in_its_log_and_its_child_is_not_waited_for(supervisor):
    """The service diagnoses a failure from the rank's last lines as soon as it is reported: those
    lines are in the rank's log by then (its runner read its pipe empty after the exit), while a
    child that still holds the pipe delays nothing and is gone with the group."""
    command = launch_command(nproc=1, entrypoint=[sys.executable, "-c", LAST_WORDS_AND_A_CHILD])
    supervisor.launch(command)
    group = supervisor.groups[command.key]
    wait_for(lambda: supervisor.reports.snapshot()[0].state == "failed", 60, "the failure",
             while_waiting=supervisor.poll)
    log = (group.paths.logs_dir / rank_log(0)).read_text()
    assert log.endswith("MemoryError: the last words\n"), log
    assert supervisor.reports.snapshot()[0].detail == "rank 0 exit code 1"
    run_to_end(supervisor, timeout=30)
    assert not pid_alive(int(log.split()[1]))


def test_hang_after_first_step_is_caught_within_the_timeout(supervisor):
    command = launch_command("--steps", "1000", "--hang-at-step", "2", hang_timeout_seconds=2.0)
    supervisor.launch(command)
    report = run_to_end(supervisor)

    assert (report["state"], report["cause"]) == ("failed", "hang")
    [hang] = [e for e in spool_events(supervisor, command, "node:node-a") if e["kind"] == "hang_detected"]
    assert hang["step"] == 2 and hang["data"]["phase"] == "train"
    # Not before the timeout (the rule); well before the 30 s init timeout (a margin no load eats).
    assert 2.0 <= hang["data"]["seconds_without_progress"] < 20.0
    exits = [e["data"] for e in spool_events(supervisor, command, "node:node-a") if e["kind"] == "worker_exited"]
    assert sorted(exits, key=lambda d: d["rank"]) == [{"rank": r, "signal": "SIGKILL"} for r in (0, 1)]
    assert not pids_with_env("ETT_JOB_ID", command.job_id)


def test_the_adaptive_limit_spares_a_slow_step_and_catches_a_hang_long_before_the_ceiling(supervisor):
    # Steps of 0.5 s; step 7 takes 2.5 s without a beat (slow but alive: spared); step 9 never
    # ends. The limit follows the longest step seen: 4 x 2.5 s = 10 s, not the 60 s ceiling.
    command = launch_command("--steps", "1000", "--step-seconds", "0.5", "--slow-step", "7", "--slow-seconds", "2.5",
                             "--hang-at-step", "9", hang_timeout_seconds=60.0)
    supervisor.launch(command)
    report = run_to_end(supervisor, timeout=60)

    assert (report["state"], report["cause"]) == ("failed", "hang")
    [hang] = [e for e in spool_events(supervisor, command, "node:node-a") if e["kind"] == "hang_detected"]
    assert hang["step"] == 9  # not 7: the slow step was spared
    assert 9.0 <= hang["data"]["timeout_seconds"] <= 12.0, hang  # 4 x the slow step, as the agent saw it
    assert hang["data"]["seconds_without_progress"] < 15.0
    assert "adaptive" in report["detail"] and "ceiling 60s" in report["detail"]


def test_no_first_step_within_init_timeout_is_a_hang(supervisor):
    command = launch_command("--hang-at-step", "0", init_timeout_seconds=4.0, hang_timeout_seconds=0.5)
    supervisor.launch(command)
    report = run_to_end(supervisor)

    assert (report["state"], report["cause"]) == ("failed", "hang")
    # The detail says what a script must do to be seen, and how to turn detection off.
    assert report["detail"].startswith("no first step within the init timeout of 4s: no rank reported")
    assert "run.step" in report["detail"] and "hang_timeout_seconds = null" in report["detail"]


def test_every_job_is_handed_the_documented_environment(supervisor, tmp_path):
    env_file = tmp_path / "env.json"
    checkpoint = {"dir": str(tmp_path / "ckpt"), "local_dir": str(tmp_path / "local"), "interval_steps": 7,
                  "keep": 2, "resume_from": str(tmp_path / "ckpt" / "step-00000007")}
    command = launch_command("--env-file", str(env_file), attempt=3, checkpoint=checkpoint)
    command = command.model_copy(update={"entrypoint": [sys.executable, str(ETT_RANK), "--env-file", str(env_file)]})
    supervisor.launch(command)
    assert run_to_end(supervisor)["state"] == "succeeded"

    env = json.loads(env_file.read_text())
    marker = env.pop("ETT_WORKER_GROUP")  # the agent's own marker, for finding leftover processes
    assert env.pop("ETT_WORKER_CGROUP") == str(supervisor.cgroups.root / "owner-0" / marker)  # its attempt's
    for name in (TEST_MARK_ENV, *WORKER_ENV):  # the suite's own (tests/conftest.py)
        env.pop(name)
    paths = AttemptPaths.of(supervisor.spool_root, command.job_id, 3)
    assert env == {
        "ETT_JOB_ID": command.job_id, "ETT_ATTEMPT": "3", "ETT_EVENT_DIR": str(paths.events_dir),
        "ETT_CHECKPOINT_DIR": checkpoint["dir"], "ETT_CHECKPOINT_LOCAL_DIR": checkpoint["local_dir"],
        "ETT_RESUME_FROM": checkpoint["resume_from"], "ETT_CHECKPOINT_INTERVAL_STEPS": "7", "ETT_CHECKPOINT_KEEP": "2",
        "ETT_CHECKPOINT_INTERVAL_FILE": str(paths.interval_file),
        "ETT_LEARN_IMPORTS": "1",  # a `python SCRIPT` naming no warm_imports: its local rank 0 says what it imported
    }  # fmt: skip
    kinds = [e["kind"] for e in spool_events(supervisor, command, "rank:0")]
    assert kinds == ["init_start", "init_end", "step", "step", "step", "step_timing", "train_end"]


def test_progress_marks_before_the_first_step_keep_a_busy_rank_alive(tmp_path, cgroups):
    # 14 s of marked work against an init timeout of 12 s: a live rank is not killed. The timeout also
    # covers a rank's start until its first mark, and `ett.init()` imports torch: started fresh, that
    # took 3 s on a 2-core Xeon alone and over 12 s beside the suite's other worker. So the ranks are
    # forked warm, as an agent's are (the base server holds torch): what is measured is the marked work.
    warm = WarmServers(tmp_path / "data", ["unused"])
    supervisor = Supervisor(tmp_path / "spool", "node-a", stop_grace_seconds=1.0, cgroups=cgroups, warm=warm)
    try:
        command = launch_command(init_timeout_seconds=12)
        command = command.model_copy(update={"entrypoint": [sys.executable, str(ETT_RANK), "--busy-seconds", "14"]})
        supervisor.launch(command)  # held until its user's base server has imported torch
        wait_for(lambda: (supervisor.poll(), supervisor.groups)[1], 120, "the launch to start")
        records = supervisor.groups[command.key].records
        wait_for(lambda: (supervisor.poll(), records.all_started)[1], 60, "both ranks to start")
        # Forked warm: each rank's parent is its keeper, a child of the server, not its runner.
        assert {parent_pid(parent_pid(pid)) for pid in records.rank_pids.values()} <= warm.pids(), records.rank_pids
        report = run_to_end(supervisor)
        assert report["state"] == "succeeded", report
    finally:
        supervisor.shutdown()
        warm.stop()


def test_the_same_work_unmarked_is_a_hang_and_null_turns_detection_off(supervisor):
    silent = [sys.executable, str(ETT_RANK), "--busy-seconds", "8", "--silent"]
    command = launch_command(init_timeout_seconds=6).model_copy(update={"entrypoint": silent})
    supervisor.launch(command)
    assert run_to_end(supervisor)["cause"] == "hang"

    supervisor.reports.acknowledge(supervisor.reports.snapshot())
    off = launch_command(init_timeout_seconds=6, hang_timeout_seconds=None).model_copy(update={"entrypoint": silent})
    supervisor.launch(off)
    assert run_to_end(supervisor)["state"] == "succeeded"


def test_stop_escalates_to_sigkill_and_leaves_no_process(supervisor):
    # The ranks ignore SIGTERM and each leave a grandchild behind: only SIGKILL and the marker scan help.
    command = launch_command("--steps", "100000", "--ignore-sigterm", "--spawn-child")
    supervisor.launch(command)
    group = supervisor.groups[command.key]
    wait_for(lambda: group.state == "running", 60, "ranks to start", while_waiting=supervisor.poll)
    # guard, torchrun, 2 runners, 2 ranks, 2 grandchildren
    wait_for(lambda: len(pids_with_env("ETT_JOB_ID", command.job_id)) == 8, 30, "the grandchildren")

    supervisor.stop(command_adapter_stop(command))
    started = time.monotonic()
    report = run_to_end(supervisor)

    assert report["state"] == "stopped" and report["detail"] == "stopped: cancelled"
    assert time.monotonic() - started < 25.0  # grace 1s, then SIGKILL; not torchrun's default 30s
    exits = [e["data"] for e in spool_events(supervisor, command, "node:node-a") if e["kind"] == "worker_exited"]
    assert {e.get("signal") for e in exits} == {"SIGKILL"}  # the ranks ignored SIGTERM: the kill ended them
    assert pids_with_env("ETT_JOB_ID", command.job_id) == []


def test_a_stop_at_once_kills_without_a_sigterm_and_leaves_no_process(supervisor):
    """A broken attempt's survivors (StopCommand.at_once): SIGKILLed, not asked to save first."""
    command = launch_command("--steps", "100000")
    supervisor.launch(command)
    group = supervisor.groups[command.key]
    wait_for(lambda: group.state == "running", 60, "ranks to start", while_waiting=supervisor.poll)

    supervisor.stop(command_adapter_stop(command, reason="attempt failed", at_once=True))
    report = run_to_end(supervisor)

    assert report["state"] == "stopped" and report["detail"] == "stopped: attempt failed"
    exits = [e["data"] for e in spool_events(supervisor, command, "node:node-a") if e["kind"] == "worker_exited"]
    assert {e.get("signal") for e in exits} == {"SIGKILL"}  # a SIGTERM would have ended these ranks itself
    assert pids_with_env("ETT_JOB_ID", command.job_id) == []


def attempt_cgroups(cgroups) -> list[Path]:
    return [p for p in cgroups.root.glob("owner-*/*") if p.is_dir() and p.name != "warm"]


@pytest.mark.skipif(os.geteuid() != 0, reason="an agent started as root makes each attempt a cgroup")
@pytest.mark.parametrize("end", ["success", "stop"])
def test_a_process_that_left_its_session_and_environment_is_gone_after_the_attempt(supervisor, tmp_path, end):
    """setsid and env -i: no process group, no session, no marker holds it; its cgroup does."""
    escaped = tmp_path / "escaped.pid"
    command = launch_command("--steps", "2" if end == "success" else "100000", "--escape", str(escaped))
    supervisor.launch(command)
    wait_for(escaped.exists, 60, "the rank to start its escape", while_waiting=supervisor.poll)
    pid = int(escaped.read_text())
    assert pid_alive(pid) and not pids_with_env("ETT_JOB_ID", command.job_id).count(pid)  # unmarked
    if end == "stop":
        supervisor.stop(command_adapter_stop(command))
    assert run_to_end(supervisor)["state"] == ("succeeded" if end == "success" else "stopped")
    assert not pid_alive(pid)
    assert not attempt_cgroups(supervisor.cgroups)  # removed


# "kill" is tested end to end in test_daemon.py. The fake ranks share no collective, so only a
# stopped rank 0 (the one that reports steps) stalls progress.
@pytest.mark.parametrize(("action", "rank", "expected"), [
    ("exit", 1, ("exit", "rank 1 exit code 5 (injected fault)", 5)),
    ("hang", 0, ("hang", None, None)),
])  # fmt: skip
def test_fault_injection_at_a_step(supervisor, action, rank, expected):
    fault = {"attempt": 0, "rank": rank, "at_step": 3, "action": action, "code": 5}
    command = launch_command("--steps", "1000", faults=[fault], hang_timeout_seconds=2.0 if action == "hang" else 60)
    supervisor.launch(command)
    report = run_to_end(supervisor)

    cause, detail, exit_code = expected
    assert (report["state"], report["cause"], report["exit_code"]) == ("failed", cause, exit_code)
    if detail:
        assert report["detail"] == detail
    steps = [e["step"] for e in spool_events(supervisor, command, "rank:0") if e["kind"] == "step"]
    assert steps[-1] >= 3  # carried out once rank 0 reached the step, not before
    assert not pids_with_env("ETT_JOB_ID", command.job_id)


def test_a_rank_killed_from_outside_is_the_cause_though_a_peer_exited_a_moment_before(supervisor):
    """A killed rank breaks its peers' collectives, and a peer's exit may be recorded before the
    kill is: the SIGKILL is the attempt's cause (rank 1 ignores torchrun's SIGTERM, so only the kill
    ends it)."""
    command = launch_command("--steps", "100000", "--fail-rank", "0", "--fail-at-step", "3", "--fail-code", "1",
                             "--ignore-sigterm")
    supervisor.launch(command)
    group = supervisor.groups[command.key]
    wait_for(lambda: group.outcome is not None, 60, "rank 0's exit", while_waiting=supervisor.poll)
    assert group.outcome.detail == "rank 0 exit code 1"
    os.kill(group.records.rank_pids[1], signal.SIGKILL)  # as a fault or the kernel's out-of-memory killer would
    report = run_to_end(supervisor)
    assert (report["state"], report["cause"], report["detail"]) == ("failed", "signal", "rank 1 killed by SIGKILL")


def test_a_pid_the_job_writes_into_its_records_is_not_signalled(supervisor):
    """The runners' records are the job's to write: a fault for rank 1, whose record a rank forged
    to name a process outside the group, signals nothing (pids are the kernel's word)."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        fault = {"attempt": 0, "rank": 1, "at_step": 2, "action": "kill"}
        command = launch_command("--steps", "8", "--step-seconds", "0.3", "--forge-pid", str(bystander.pid),
                                 faults=[fault])
        supervisor.launch(command)
        report = run_to_end(supervisor)
        assert report["state"] == "succeeded"  # the fault found no process of the group to kill
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def command_adapter_stop(command, **fields):
    from ett.protocol.messages import command_adapter

    return command_adapter.validate_python({"type": "stop", "job_id": command.job_id, "attempt": command.attempt,
                                            "reason": "cancelled", **fields})


AGENT_CRASH_SCRIPT = """
import os, sys, time
from pathlib import Path
from agent.confinement.cgroups import NodeCgroups
from agent.groups.supervisor import Supervisor
from tests.agent.helpers import launch_command
from tests.support.waiting import wait_for
cgroups = NodeCgroups(sys.argv[3]) if os.geteuid() == 0 else None
supervisor = Supervisor(Path(sys.argv[1]), "node-a", 1.0, cgroups=cgroups)
command = launch_command("--steps", "100000", "--spawn-child", "--escape", sys.argv[4], job_id=sys.argv[2])
supervisor.launch(command)
while True:
    supervisor.poll()
    time.sleep(0.05)
"""


def test_a_crashed_agent_leaves_no_orphan(tmp_path, cgroups):
    job_id = os.urandom(8).hex()
    escaped = tmp_path / "escaped.pid"
    node = cgroups.root.name.removeprefix("ett-") if cgroups is not None and cgroups.root else "none"
    agent = subprocess.Popen([sys.executable, "-c", AGENT_CRASH_SCRIPT, str(tmp_path), job_id, node, str(escaped)])
    try:
        wait_for(lambda: len(pids_with_env("ETT_JOB_ID", job_id)) == 8 and escaped.exists(), 60,
                 "guard, torchrun, 2 runners, 2 ranks, 2 grandchildren, and the escape")
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait()
    wait_for(lambda: not pids_with_env("ETT_JOB_ID", job_id), 15, "the guard to clear the group")
    if cgroups is not None:  # the guard emptied the attempt's cgroup too, itself last
        wait_for(lambda: not pid_alive(int(escaped.read_text())), 15, "the escaped process to go with its cgroup")
        for attempt in attempt_cgroups(cgroups):  # the dead agent's; a new one would remove it (Supervisor.recover)
            assert remove_when_released(attempt, wait=15)  # once the guard, last in it, is gone


def test_a_ranks_full_disk_is_read_from_its_progress_mark(supervisor):
    # The rank's writer keeps "<step> <beats> <unwritten> <dropped>" (tests/ett/checkpoints/test_full_disk.py
    # shows it on a real full disk); the agent sums the node's ranks for its heartbeat and metrics.
    silent = [sys.executable, str(ETT_RANK), "--busy-seconds", "20", "--silent"]
    command = launch_command(init_timeout_seconds=60).model_copy(update={"entrypoint": silent})
    supervisor.launch(command)
    events_dir = AttemptPaths.of(supervisor.spool_root, command.job_id, 0).events_dir
    wait_for(lambda: len(list(events_dir.glob(PROGRESS_GLOB))) == 2, 60, "both marks",
             while_waiting=supervisor.poll)
    (events_dir / progress_file(1)).write_text("0 0 5 2".rjust(64))  # as rank 1's writer on a full disk
    wait_for(lambda: supervisor.rank_events_unwritten_and_dropped() == (5, 2), 10, "the report",
             while_waiting=supervisor.poll)
    supervisor.stop(command_adapter_stop(command))
    run_to_end(supervisor)


def test_a_success_is_reported_once_the_ranks_exit_while_torchrun_waits_for_the_other_node(tmp_path):
    # Node 0's ranks finish first; its torchrun then waits in its exit barrier for node 1's.
    nodes = [Supervisor(tmp_path / f"spool-{n}", f"node-{n}", stop_grace_seconds=1.0) for n in range(2)]
    port, job_id = free_port(), uuid.uuid4().hex
    for node_rank, steps in ((0, "2"), (1, "40")):
        nodes[node_rank].launch(launch_command("--steps", steps, "--step-seconds", "0.1", nnodes=2, node_rank=node_rank,
                                               master_port=port, job_id=job_id))
    try:
        first, second = nodes
        wait_for(lambda: first.reports.snapshot()[0].state != "running", 60, "node 0's ranks", while_waiting=first.poll)
        assert first.reports.snapshot()[0].state == "succeeded"
        [group] = first.groups.values()
        assert not group.state.is_terminal, "reported only once torchrun had exited"
        for node in nodes:
            wait_for(lambda: not node.groups, 60, "the group to end", while_waiting=node.poll)
            assert node.reports.snapshot()[0].state == "succeeded"
    finally:
        for node in nodes:
            node.shutdown()


@pytest.mark.parametrize(("stall", "limit", "kernel_word"), [("freeze", STOPPED_SECONDS, "(process stopped)"),
                                                           ("block", FROZEN_SECONDS, "(process state S)")])
@pytest.mark.parametrize("at_step", [3, 0], ids=["in a step", "as init returns"])
def test_a_frozen_rank_is_a_hang_within_the_frozen_limit_far_below_the_adaptive_floor(supervisor, stall, limit,
                                                                                     kernel_word, at_step):
    # Rank 1 stops itself (SIGSTOP), or waits in C code with the GIL held, in step 3 of 0.05 s steps
    # (the ceiling, 30 s, would still apply, the adaptive limit's 3 s floor after 5 steps), or as soon as
    # ett.init() returns, before the library's thread may have run: its progress mark is there already.
    # Only the kernel's "stopped" takes the shorter limit.
    entrypoint = [sys.executable, str(ETT_RANK), "--steps", "1000", "--stall-at-step", str(at_step), "--stall", stall,
                  "--stall-seconds", "30"]
    command = launch_command(hang_timeout_seconds=30, init_timeout_seconds=60).model_copy(
        update={"entrypoint": entrypoint})
    supervisor.launch(command)
    report = run_to_end(supervisor)

    assert (report["state"], report["cause"]) == ("failed", "hang")
    assert report["detail"].startswith("rank 1 frozen "), report["detail"]  # after rank 0's steps, or before any
    assert kernel_word in report["detail"], report["detail"]
    [hang] = [e for e in spool_events(supervisor, command, "node:node-a") if e["kind"] == "hang_detected"]
    assert hang["data"]["timeout_seconds"] == limit
    assert limit <= hang["data"]["seconds_without_progress"] < 3.0  # below the floor, by a margin


@pytest.mark.parametrize("wrapped", [False, True], ids=["python", "through a shell"])
def test_a_slow_but_live_rank_is_not_frozen(supervisor, wrapped):
    # 2 s in step 3 (the ceiling, 30 s, still applies: load may stretch a computation past the
    # adaptive floor): more than the frozen limit. Rank 0 sleeps: its pulse goes on; rank 1
    # computes with the GIL held: its CPU time goes up. Through a shell that waits for it (`bash
    # train.sh`: the `exit` keeps sh from exec'ing it), the CPU time is its child's, not the rank's pid's.
    entrypoint = [sys.executable, str(ETT_RANK), "--steps", "12", "--stall-at-step", "3", "--stall", "sleep,spin",
                  "--stall-seconds", "2"]
    if wrapped:
        entrypoint = ["sh", "-c", f'{shlex.join(entrypoint)}; exit "$?"']
    command = launch_command(hang_timeout_seconds=30).model_copy(update={"entrypoint": entrypoint})
    supervisor.launch(command)
    report = run_to_end(supervisor)
    assert report["state"] == "succeeded", report
