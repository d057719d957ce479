"""A job's uid moves no process out of its attempt's cgroup, and nothing of that uid outlives its
owner's last attempt on the node (agent.confinement.cgroups): the agent's real parts as root (its
cgroups and placer, supervisors, warm servers), real torchrun and ranks as owners' own uids.

Two attempts of one owner side by side (an agent runs one at a time; two supervisors on one node's
cgroups run two) tell the attempt's own kill from the owner's sweep by uid, which waits for the
owner's last attempt: what the first attempt left, out of its session and environment, goes with
that attempt, or not at all."""

import contextlib
import json
import os
import random
import subprocess
import tempfile
from pathlib import Path

import pytest

from agent.confinement.cgroup_end import PROCS, remove_when_released
from agent.confinement.cgroups import NodeCgroups
from agent.confinement.job_user import JobUser, JobUsers
from agent.confinement.uid_sweep import parent_pid, processes_of, sweep_uid
from agent.groups.supervisor import Supervisor
from agent.warm.servers import WarmServers
from ett.protocol.messages import AttemptReport, LaunchCommand, StopCommand
from tests.agent.helpers import launch_command
from tests.support.job_user import job_python, open_folder
from tests.support.processes import pid_alive
from tests.support.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="an agent started as root runs owners' uids in cgroups")

CLIMBER = Path(__file__).parents[1] / "scripts" / "climbing_rank.py"
REFUSED = {"EACCES", "EPERM"}


@pytest.fixture(scope="module")
def open_root():
    """A folder other users may enter (pytest's are closed to them), with a job interpreter."""
    with open_folder("ett-cgroups-") as root:
        job_python(root / "python")
        yield root


class Node:
    """One node's agent parts as an agent started as root has them, with a supervisor per attempt."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cgroups = NodeCgroups(f"test-{os.getpid()}-{root.name}", root / "agent")
        if self.cgroups.root is None:
            pytest.skip("no writable cgroup v2 on this machine")
        assert self.cgroups.placer is not None
        base = 1_800_000_000 + random.randrange(100_000) * 1_000  # no other test's owners
        self.users = JobUsers(str(root.parent / "python" / "bin" / "python"), None, base, 1_000, root / "homes")
        self.warm = WarmServers(root / "data", ["unused"], self.cgroups)
        self.supervisors: list[Supervisor] = []

    def uid(self, owner_number: int) -> int:
        return self.users.uid_base + owner_number

    def supervisor(self, warm: bool = False) -> Supervisor:
        supervisor = Supervisor(self.root / f"spool-{len(self.supervisors)}", "node-a", 1.0,
                                warm=self.warm if warm else None, job_users=self.users, cgroups=self.cgroups)
        self.supervisors.append(supervisor)
        return supervisor

    def poll(self) -> None:
        for supervisor in self.supervisors:
            supervisor.poll()

    def launch(self, supervisor: Supervisor, owner_number: int, out: str, *args: str, warm: bool = False
               ) -> tuple[LaunchCommand, Path]:
        folder = self.root / out
        folder.mkdir()
        folder.chmod(0o777)  # the rank writes what it saw there, as its owner's uid
        command = launch_command(nproc=1, owner=f"owner{owner_number}", owner_number=owner_number,
                                 hang_timeout_seconds=None, warm_imports=["json"] if warm else [],
                                 entrypoint=[self.users.python, str(CLIMBER), str(folder), *args])
        if warm:  # its owner's warm server listening first: the launch forks from it, never starts cold
            server = self.warm.for_user(self.users.run_as(command), command.warm_imports)
            server.ensure_running()
            wait_for(server.socket_path.exists, 180, "the warm server to listen", while_waiting=self.poll,
                     explain=lambda: server.log_path.read_text())
        supervisor.launch(command)
        return command, folder

    def seen(self, path: Path, what: str) -> dict:
        wait_for(path.exists, 120, what, while_waiting=self.poll)
        return json.loads(path.read_text())

    def run_to_end(self, supervisor: Supervisor, command: LaunchCommand) -> AttemptReport:
        def ended() -> AttemptReport | None:
            if command.key in supervisor.groups or command.key in supervisor.held:
                return None
            return next((r for r in supervisor.reports.snapshot() if (r.job_id, r.attempt) == command.key), None)
        return wait_for(ended, 120, f"attempt {command.job_id} to end", while_waiting=self.poll)

    def stop(self, supervisor: Supervisor, command: LaunchCommand) -> AttemptReport:
        supervisor.stop(StopCommand(type="stop", job_id=command.job_id, attempt=command.attempt, reason="done"))
        return self.run_to_end(supervisor, command)

    def close(self) -> None:
        for supervisor in self.supervisors:
            supervisor.shutdown()
        self.warm.stop()
        self.cgroups.close()
        for number in range(1, 4):  # whatever a failed test left of its owners
            sweep_uid(self.uid(number), lambda pid: False)
        assert self.cgroups.root is not None
        for folder in sorted(self.cgroups.root.glob("**/"), key=lambda p: len(p.parts), reverse=True):
            remove_when_released(folder)


@pytest.fixture
def node(open_root):
    folder = Path(tempfile.mkdtemp(prefix="n", dir=open_root))  # short: sockets' paths fit in 107 bytes
    folder.chmod(0o755)
    node = Node(folder)
    yield node
    node.close()


def only_warm_servers_left(node: Node, uid: int) -> list[int]:
    """The uid's live processes that are neither a warm server of the agent nor one's keeper."""
    servers = node.warm.pids()
    return [pid for pid in processes_of(uid) if pid not in servers and parent_pid(pid) not in servers]


@pytest.mark.parametrize("start", ["fresh", "warm"])
def test_a_rank_that_climbs_its_cgroup_tree_and_double_forks_is_refused_and_gone_with_its_attempt(node, start):
    bystander = node.supervisor()  # another owner's job on the node, running throughout
    other, other_out = node.launch(bystander, 2, "bystander", "--stay")
    other_rank = node.seen(other_out / "rank-0.json", "the other owner's rank")

    hostile = node.supervisor(warm=start == "warm")
    command, out = node.launch(hostile, 1, "hostile", warm=start == "warm")
    attempt, uid = hostile.groups[command.key].cgroup, node.uid(1)
    rank, daemon = node.seen(out / "rank-0.json", "the rank's tries"), node.seen(out / "daemon.json", "the child's")
    assert rank["warm_forked"] == (start == "warm")  # forked by its owner's warm server, moved by the agent
    for tried in (rank, daemon):  # the rank, and its double-forked child out of its session, env -i
        assert tried["uid"] == uid and tried["cgroup"] == tried["after"] == str(attempt)
        assert {tried["owner"], tried["warm"], tried["root"]} <= REFUSED, tried  # up its tree: refused
    assert rank["placer_owner"].startswith("refused: not a live attempt")  # the agent moves no one there
    assert rank["placer_own_attempt"].startswith("refused: only a process its warm server forked")

    assert node.run_to_end(hostile, command).state == "succeeded"
    assert not pid_alive(daemon["pid"])
    assert only_warm_servers_left(node, uid) == []  # by uid: nothing of the owner but its warm server
    if start == "fresh":
        assert processes_of(uid) == []

    assert pid_alive(other_rank["pid"])  # the other owner's job ran on, and stops as it should
    assert node.stop(bystander, other).state == "stopped"
    assert processes_of(node.uid(2)) == []


def test_the_attempts_own_kill_ends_what_nothing_else_finds_while_its_owner_runs_another_attempt(node):
    """The first attempt's child left its session and environment (no marker finds it), and its
    owner's second attempt still runs (no sweep by uid comes yet): only the kill of the first
    attempt's cgroup ends it, when that attempt ends, and it could not hide in the second one."""
    second_supervisor, first_supervisor = node.supervisor(), node.supervisor()
    second, second_out = node.launch(second_supervisor, 1, "second", "--stay")
    second_rank = node.seen(second_out / "rank-0.json", "the second attempt's rank")

    first, first_out = node.launch(first_supervisor, 1, "first")
    daemon = node.seen(first_out / "daemon.json", "the first attempt's child")
    assert Path(f"/proc/{daemon['pid']}/environ").read_bytes() == b""  # no marker to find it by
    second_cgroup = Path(second_rank["cgroup"]).name
    assert set(daemon["other_attempts"]) == {second_cgroup} and set(daemon["other_attempts"].values()) <= REFUSED

    assert node.run_to_end(first_supervisor, first).state == "succeeded"
    assert not pid_alive(daemon["pid"])  # gone with its attempt, not at its owner's last
    assert pid_alive(second_rank["pid"])
    assert node.stop(second_supervisor, second).state == "stopped"
    assert processes_of(node.uid(1)) == []


def test_the_owners_last_attempt_sweeps_its_uid_wherever_it_runs_but_in_another_agents_attempt(node):
    """What the job's user got started outside the agent's cgroups (its service manager, `at`) is
    found by its uid; a process of the same uid in another agent's live attempt (two agents on one
    machine share owners' uids) is that agent's."""
    user = node.users.run_as(launch_command(owner="owner3", owner_number=3)).user
    assert isinstance(user, JobUser) and user.owners_alone
    elsewhere = node.cgroups.mount / f"elsewhere-{os.getpid()}-{random.randrange(1 << 30)}"  # no agent's
    elsewhere.mkdir()
    other_agent = NodeCgroups(f"test-{os.getpid()}-{node.root.name}-other")
    sleepers = []
    try:
        other_attempt = other_agent.attempt(user, "its-attempt")
        for cgroup in (elsewhere, other_attempt):
            sleeper = subprocess.Popen(["sleep", "600"], user=user.uid, group=user.gid, extra_groups=[])
            (cgroup / PROCS).write_text(str(sleeper.pid))
            sleepers.append(sleeper)
        node.cgroups.attempt(user, "ours")
        node.cgroups.end("ours")  # its last attempt on this agent
        assert sleepers[0].wait(timeout=10) == -9  # swept by uid
        assert sleepers[1].poll() is None  # the other agent's attempt runs on
        other_agent.end("its-attempt")
        assert sleepers[1].wait(timeout=10) == -9
    finally:
        for sleeper in sleepers:
            with contextlib.suppress(ProcessLookupError):
                sleeper.kill()
            sleeper.wait()
        remove_when_released(elsewhere)
        assert other_agent.root is not None
        for folder in sorted(other_agent.root.glob("**/"), key=lambda p: len(p.parts), reverse=True):
            remove_when_released(folder)
