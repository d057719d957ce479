"""One attempt's worker group on this node: its state machine and its non-blocking poll.

    LAUNCHING --all local ranks started--> RUNNING --torchrun exits--> SUCCEEDED | FAILED
        |                                     |
        +-----stop / hang (agent tears down)--+--> STOPPING --torchrun exits--> STOPPED | FAILED

A rank that fails makes torchrun tear the others down; the first failure a rank runner records is the attempt's cause,
reported as soon as that rank's last output is in its log (the service diagnoses from those lines), before the group is
gone. A success is reported once every local rank exited cleanly, before torchrun's own wind-down, which is not waited
for after a failure or a stop either. A hang is torn down at once with SIGKILL; a stop gets SIGTERM, then SIGKILL after
a grace (one `at_once`, a broken attempt's: SIGKILL now). At the end every process carrying the group's marker is
SIGKILLed and the attempt's cgroup frozen, killed and waited for (agent.confinement.cgroups). A pid in the ranks'
records (the job's) is signalled only while the kernel says the group owns it. What the job wrote that the agent cannot
handle fails the attempt, never the agent. The group's parts: its states (agent.groups.states), its runners' records
(agent.groups.rank_records), its ranks' progress and hangs (agent.groups.progress), its watched processes
(agent.groups.wakeup); the group decides how it ends and acts on it.
"""
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from signal import SIGKILL, SIGTERM

from agent.confinement.cgroup_end import PROCS, kill_cgroup, pids_in
from agent.confinement.cgroups import NodeCgroups
from agent.confinement.job_user import RunAs, make_passable
from agent.confinement.procs import GROUP_MARKER_ENV, process_uid, signal_group, signal_marked
from agent.files.beneath import remove_tree
from agent.files.spool import AttemptPaths, NodeEventLog, write_private
from agent.groups.faults import FaultInjector
from agent.groups.progress import Progress
from agent.groups.rank_records import RankRecords, end_of_rank
from agent.groups.states import GroupEnd, WorkerState
from agent.groups.wakeup import ExitWatch
from agent.launching.launch import rank_argv, torchrun_argv, worker_env
from agent.launching.rank_log import DEFAULT_MAX_BYTES, last_line
from ett.protocol import EXIT_CONFIG_ERROR
from ett.protocol.event_fields import HangDetectedData, WorkersLaunchedData
from ett.protocol.messages import REPORT_DETAIL_CHARS, LaunchCommand

log = logging.getLogger(__name__)

# How soon after a peer's plain exit a rank's SIGKILL is still taken for the cause (_is_root_cause).
ROOT_CAUSE_SECONDS = 1.0


class WorkerGroup:
    def __init__(self, command: LaunchCommand, paths: AttemptPaths, node_name: str, stop_grace_seconds: float,
                 clock: Callable[[], float] = time.monotonic, warm_socket: Path | None = None,
                 run_as: RunAs = RunAs(), cgroups: NodeCgroups | None = None,
                 spare: Callable[[], set[int]] = set, rank_log_max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.command = command
        self.run_as = run_as  # the job's interpreter and user (agent.confinement.job_user)
        self.warm_socket = warm_socket  # the agent's warm server (agent.warm.server), if it runs one
        self.paths = paths
        self.stop_grace_seconds, self.clock = stop_grace_seconds, clock
        self.state = WorkerState.LAUNCHING
        self.end: GroupEnd | None = None
        # What the service was last told (Supervisor._report); reported_state moves with the clock too.
        self.told: tuple[str, GroupEnd | None] | None = None
        self.marker = f"{command.job_id}.{command.attempt}.{uuid.uuid4().hex[:12]}"
        self.cgroups = cgroups  # this node's cgroups (agent.confinement.cgroups), if the machine gives it any
        self.spare = spare  # the warm servers' pids: their keepers outlive an attempt, nothing else
        self.cgroup: Path | None = None  # the attempt's own, made at start
        self.rank_log_max_bytes = rank_log_max_bytes  # each rank's output is rotated at this size
        make_passable(paths.root)  # the agent's: the job passes through to its two folders
        for folder in (paths.events_dir, paths.control_dir, paths.logs_dir):
            run_as.make_own(folder)  # the ranks write their events, records and output there
        write_private(paths.launch_file, command.model_dump_json(exclude={"env"}).encode())  # its env may hold secrets
        self.events = NodeEventLog(paths.node_spool(node_name), node_name, command.attempt)
        self._faults = FaultInjector(command.faults, paths, self.owns, self.lose_node)
        self.records = RankRecords(paths.ranks_file, command.nproc_per_node, self._watch_runner,
                                   command.nnodes * command.nproc_per_node)
        self._proc: subprocess.Popen[bytes] | None = None
        self.progress = Progress(command, paths.events_dir, clock())
        self._ending: GroupEnd | None = None  # decided; waiting for the processes to go
        self._ending_at: float | None = None
        self._ending_rank: int | None = None  # the rank whose exit record decided it
        self._killed_at: float | None = None  # when the agent SIGKILLed the group
        self._kill_at: float | None = None
        self._exits = ExitWatch()  # torchrun's guard and the rank runners (agent.groups.wakeup)
        self._files_failed = False  # the job's files could not be handled: read no more of them

    @property
    def live_ranks(self) -> int:
        return 0 if self.state.is_terminal else len(self.records.rank_pids) - len(self.records.exited)

    @property
    def outcome(self) -> GroupEnd | None:
        """How the group ends, known from the moment it is decided."""
        return self.end or self._ending

    @property
    def reported_state(self) -> str:
        """The attempt state the service is told: a failure as soon as it is decided and the failed
        rank's last output is in its log, a success as soon as every local rank has exited cleanly
        (torchrun's own wind-down, a monitor period and its exit barrier, is not the job's time)."""
        failed_ranks = set() if self._ending_rank is None else {self._ending_rank}  # none for a hang
        if (not self.state.is_terminal and self._ending is not None and self._ending.state == WorkerState.FAILED
                and self.records.output_in(failed_ranks, self.clock(), self._exits)):
            return WorkerState.FAILED.value
        if not self.state.is_terminal and self._ending is None and self.records.all_succeeded:
            return WorkerState.SUCCEEDED.value
        return self.state.reported

    def start(self) -> None:
        """Starts torchrun's guard, puts it into the attempt's cgroup, then lets it go on."""
        if self.cgroups is not None and self.run_as.user is not None:
            self.cgroup = self.cgroups.attempt(self.run_as.user, self.marker)
        go_read, go_write = os.pipe()
        try:
            with open(os.open(self.paths.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as log_file:
                self._proc = subprocess.Popen(
                    torchrun_argv(self.command, self.paths, self.run_as.python, go_read, self.rank_log_max_bytes),
                    env=worker_env(self.command, self.paths, self.marker, self.warm_socket, self.run_as, self.cgroup,
                                   self.cgroups.placer_socket if self.cgroups is not None else None),
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, pass_fds=(go_read,),
                    start_new_session=True, **self.run_as.popen())  # fmt: skip
            if self.cgroup is not None:
                (self.cgroup / PROCS).write_text(str(self._proc.pid))
            os.write(go_write, b"1")
        except BaseException:
            self._end_cgroup()  # nothing runs: its user's last attempt here may have ended
            raise
        finally:
            os.close(go_read)
            os.close(go_write)  # unwritten: the guard starts nothing and exits
        self.progress.launched(self.clock())
        self._exits.watch(self._proc.pid)
        self.events.emit("workers_launched", WorkersLaunchedData(
            node_rank=self.command.node_rank, nproc_per_node=self.command.nproc_per_node,
            pid=self._proc.pid, argv=rank_argv(self.command, self.run_as.python),
        ))  # fmt: skip
        log.info("attempt %s/%d launched (guard pid %d)", self.command.job_id, self.command.attempt, self._proc.pid)

    def stop(self, reason: str, failure: GroupEnd | None = None, at_once: bool = False) -> None:
        """SIGTERM to the group, SIGKILL after the grace; `at_once` (StopCommand's): SIGKILL now. `failure`: the
        stop ends the attempt as this failure (Slurm's time limit or preemption) rather than as stopped."""
        if not self.state.is_terminal and self._proc is not None:
            self._read_rank_records(self.clock())  # a rank that already failed here is the cause, not the stop
        if self.state.is_terminal or self._ending is not None or self._proc is None:
            return  # already ending (its failed rank's last output still to reach its log): the first cause stands
        self._ending = failure or GroupEnd(WorkerState.STOPPED, None, f"stopped: {reason}" if reason else "stopped")
        self.state = WorkerState.STOPPING
        if at_once:
            return self.kill()
        signal_group(self._proc.pid, SIGTERM)  # torchrun passes it on to the ranks
        self._kill_at = self.clock() + self.stop_grace_seconds

    def poll(self) -> bool:
        """Looks at the group once without blocking; True when its state changed."""
        if self.state.is_terminal or self._proc is None:
            return False
        before = self.state
        now = self.clock()
        self._exits.forget_exited()  # before the records: a runner writes its record, then exits
        self._read_rank_records(now)
        self._read_progress(now)
        if self._proc.poll() is not None:
            self._finish()
        elif self._kill_at is not None and now >= self._kill_at:
            self.kill()
        elif self._ending is None and not self.records.all_exited:
            self._check_hang(now)
        return self.state != before

    def fail_on_its_files(self, problem: str) -> None:
        """What the job wrote could not be handled: the attempt fails so, as a configuration error (its
        files would say the same again), its processes killed, nothing more of its files read."""
        self._files_failed = True
        if self.state.is_terminal:
            return
        detail = f"the agent could not handle the job's files: {problem}"[:REPORT_DETAIL_CHARS]
        self._ending, self._ending_rank = GroupEnd(WorkerState.FAILED, "exit", detail, EXIT_CONFIG_ERROR), None
        self.state = WorkerState.STOPPING
        self.kill()

    def kill(self) -> None:
        """SIGKILL to every process of the group; poll() then sees torchrun gone."""
        self._kill_at, self._killed_at = None, self.clock()
        if self._proc is not None:
            signal_group(self._proc.pid, SIGKILL)
        signal_marked(GROUP_MARKER_ENV, self.marker, SIGKILL)
        if self.cgroup is not None:
            kill_cgroup(self.cgroup)

    def lose_node(self) -> None:
        """The `lose_node` drill: this node goes as a dead machine would. Every process of the group, the
        job's node-local checkpoints (snapshots, copies kept for peers), then the agent, SIGKILLed: no report;
        its guard empties its cgroups, the service learns of it from the peers' failure and missing heartbeats."""
        log.warning("fault injection: losing this node (the ranks, the local checkpoints, the agent)")
        self.kill()
        self.remove_local_checkpoints()
        os.kill(os.getpid(), SIGKILL)

    def remove_local_checkpoints(self) -> None:
        """Removes the job's node-local checkpoint folder (the agent names it, in its own root). The
        job writes inside it, any depth: removed without following a link (agent.files.beneath)."""
        if self.command.checkpoint.local_dir is not None:
            remove_tree(self.command.checkpoint.local_dir)

    def owns(self, pid: int) -> bool:
        """Whether `pid` is a process of this group, by the kernel's word (not the job's records):
        in its cgroup; without one, a process of the job's user (a warm-forked rank's environment
        in /proc is its server's, so the marker cannot say)."""
        if self.cgroup is not None:
            return pid in pids_in(self.cgroup)
        return process_uid(pid) == (self.run_as.user.uid if self.run_as.user is not None else os.geteuid())

    @property
    def exit_fds(self) -> list[int]:
        """pidfds of the processes whose exit the monitor loop should wake for."""
        return self._exits.fds

    def _watch_runner(self, pid: int) -> None:
        if self.owns(pid):
            self._exits.watch(pid)

    def _read_rank_records(self, now: float) -> None:
        if self._files_failed:
            return
        for rank, record in self.records.read(now):
            self.events.emit("worker_exited", record)  # its type's fields alone (agent.groups.rank_records)
            failure = end_of_rank(record)
            if failure is not None and self._ending is None:
                log.warning("attempt %s/%d: %s", self.command.job_id, self.command.attempt, failure.detail)
                self._ending, self._ending_at, self._ending_rank = failure, now, rank
                self._kill_at = now + self.stop_grace_seconds  # torchrun tears the rest down itself first
            elif failure is not None and self._is_root_cause(failure, now):
                log.warning("attempt %s/%d: %s, the cause of %s", self.command.job_id, self.command.attempt,
                            failure.detail, self._ending.detail if self._ending else "")
                self._ending, self._ending_rank = failure, rank
        if self.state == WorkerState.LAUNCHING and self.records.all_started:
            self.state = WorkerState.RUNNING
        if self.records.all_exited and self._kill_at is None:
            self._kill_at = now + self.stop_grace_seconds  # torchrun should follow its ranks out
        ended = self.records.all_exited and self._ending is not None
        if ended and self.records.output_in(set(self.records.exited), now, self._exits):
            self._kill_at = now  # a failed or stopped group: nothing of torchrun's own teardown is needed

    def _is_root_cause(self, failure: GroupEnd, now: float) -> bool:
        """A rank SIGKILLed from outside (a fault, the kernel's out-of-memory killer) breaks its
        peers' collectives, and a peer's plain exit may be recorded a moment before its runner
        records the kill: the kill is the cause. Not once the agent itself has killed the group."""
        return (self._ending is not None and self._ending.state == WorkerState.FAILED and self._ending.cause == "exit"
                and failure.cause == "signal" and "SIGKILL" in failure.detail and self._killed_at is None
                and now - (self._ending_at or now) <= ROOT_CAUSE_SECONDS)

    def _read_progress(self, now: float) -> None:
        if self._files_failed:
            return
        self.progress.read(now, {rank: pid for rank, pid in self.records.rank_pids.items() if rank not in self.records.exited})
        step = self.progress.last_step
        if step is not None and self._faults.pending and self._ending is None:
            self._faults.on_step(step, self.records.rank_pids, self.records.runner_pids)

    def _check_hang(self, now: float) -> None:
        hang = self.progress.hang(now, self.records.rank_pids, self.owns)
        if hang is None:
            return
        phase, waited, limit, detail = hang
        log.warning("attempt %s/%d: %s", self.command.job_id, self.command.attempt, detail)
        data = HangDetectedData(phase=phase, seconds_without_progress=round(waited, 3), timeout_seconds=round(limit, 3))
        self.events.emit("hang_detected", data, step=self.progress.last_step)
        self._ending = GroupEnd(WorkerState.FAILED, "hang", detail)
        self.state = WorkerState.STOPPING
        self.kill()

    def _end_cgroup(self) -> None:  # frozen, killed, emptied; its user swept after their last attempt here
        if self.cgroups is not None and self.run_as.user is not None:
            self.cgroups.end(self.marker, self.spare())

    def _finish(self) -> None:
        assert self._proc is not None
        self._read_rank_records(self.clock())
        for _, record in self.records.unrecorded(self.clock):
            self.events.emit("worker_exited", record)
        leftovers = signal_marked(GROUP_MARKER_ENV, self.marker, SIGKILL)
        if leftovers:
            log.warning("attempt %s/%d: killed %d leftover processes", *self.command.key, leftovers)
        self._end_cgroup()
        self.records.close()
        code = self._proc.returncode
        if self._ending is not None:
            self.end = self._ending
        elif code == 0 or self.records.all_succeeded:
            # Every rank here succeeded: torchrun's own end (its exit barrier across nodes) is not ours.
            self.end = GroupEnd(WorkerState.SUCCEEDED)
        else:
            # No rank started: torchrun's own last word says why (its rendezvous port in use, say).
            said = f": {line}" if not self.records.rank_pids and (line := last_line(str(self.paths.log_file))) else ""
            detail = f"torchrun exit code {code}{said} (see {self.paths.log_file})"
            self.end = GroupEnd(WorkerState.FAILED, "exit", detail[:REPORT_DETAIL_CHARS], code)
        self.state = self.end.state
        self._exits.forget_exited(everything=True)
        write_private(self.paths.ended_marker, self.state.value.encode())
        log.info("attempt %s/%d %s %s", self.command.job_id, self.command.attempt, self.state, self.end.detail)
