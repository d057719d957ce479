"""One attempt's worker group on this node: its state machine and its non-blocking poll.

    LAUNCHING --all local ranks started--> RUNNING --torchrun exits--> SUCCEEDED | FAILED
        |                                     |
        +-----stop / hang (agent tears down)--+--> STOPPING --torchrun exits--> STOPPED | FAILED

A rank that fails makes torchrun tear the others down; the first failure recorded by a rank runner
is the attempt's cause, reported as soon as that rank's last output is in its log (its runner says
so once it has read the rank's pipe empty: the service diagnoses from those lines), before the
group is gone: the service stops the other nodes and plans the restart meanwhile.
Likewise a success is reported once every local rank has exited cleanly, before torchrun's own
wind-down. Once every local rank has exited after a failure or a stop and its output is in its log,
torchrun is not waited for (it takes seconds to wind down). A hang is torn down at once with
SIGKILL: the group is broken and its last committed checkpoint is all that counts. A stop gets
SIGTERM, then SIGKILL after a grace. Whatever happens, every process carrying the group's marker is
SIGKILLed at the end, and the attempt's cgroup is emptied (agent.confinement.cgroups): a rank that left its
session and its environment behind is gone too.
Process ids are the kernel's: a pid in the ranks' records (the job's to write) is signalled only
while it is in the attempt's cgroup (or, without one, carries the group's marker).
"""

import enum
import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from signal import SIGKILL, SIGTERM
from typing import Any

from agent.confinement.cgroups import PROCS, NodeCgroups, kill_cgroup, pids_in
from agent.confinement.job_user import RunAs, make_passable
from agent.confinement.procs import GROUP_MARKER_ENV, cpu_and_state, process_uid, signal_group, signal_marked
from agent.files.spool import AttemptPaths, NodeEventLog, SpoolReader, write_private
from agent.groups.faults import FaultInjector
from agent.groups.hang import FrozenRanks, HangLimit
from agent.groups.oom import OomWatch
from agent.groups.wakeup import exited, open_pidfd
from agent.launching.launch import rank_argv, torchrun_argv, worker_env
from agent.launching.rank_log import DEFAULT_MAX_BYTES, OUTPUT_DRAIN_SECONDS, OUTPUT_IN_LOG
from ett.events import read_progress_mark
from ett.protocol import FROZEN_SECONDS, PROGRESS_GLOB, RANK_SPOOL_GLOB, rank_of_progress_file
from ett.protocol.messages import LaunchCommand

log = logging.getLogger(__name__)

# What a rank runner's exit record passes on in a worker_exited event.
WORKER_EXITED_FIELDS = ("rank", "exit_code", "signal", "fault", "error", "oom")
# How soon after a peer's plain exit a rank's SIGKILL is still taken for the cause (_is_root_cause).
ROOT_CAUSE_SECONDS = 1.0
# How long after a rank's exit record its output is waited for at most (its runner's drain, and a margin).
OUTPUT_WAIT_SECONDS = OUTPUT_DRAIN_SECONDS + 0.5


class WorkerState(enum.StrEnum):
    LAUNCHING = "launching"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def is_terminal(self) -> bool:
        return self in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED)

    @property
    def reported(self) -> str:
        """The attempt state the service knows (docs/architecture.md, Heartbeat)."""
        return self.value if self.is_terminal else "running"


@dataclass(frozen=True)
class GroupEnd:
    state: WorkerState
    cause: str | None = None  # exit | signal | hang | time_limit | preempted | terminated
    detail: str = ""
    exit_code: int | None = None


def end_of_rank(record: dict[str, Any]) -> GroupEnd | None:
    """The failure a rank runner's exit record describes, or None for a clean exit."""
    rank = record["rank"]
    if "signal" in record:
        oom = f": the kernel's out-of-memory killer ({record['oom']})" if record.get("oom") else ""
        return GroupEnd(WorkerState.FAILED, "signal", f"rank {rank} killed by {record['signal']}{oom}")
    code = record.get("exit_code")
    if code == 0:
        return None
    if record.get("error"):  # the rank's program could not be started at all (agent.launching.launch_check)
        return GroupEnd(WorkerState.FAILED, "exit", f"rank {rank} cannot start: {record['error']}", code)
    note = " (injected fault)" if record.get("fault") else ""
    return GroupEnd(WorkerState.FAILED, "exit", f"rank {rank} exit code {code}{note}", code)


class WorkerGroup:
    def __init__(self, command: LaunchCommand, paths: AttemptPaths, node_name: str, stop_grace_seconds: float,
                 clock: Callable[[], float] = time.monotonic, warm_socket: Path | None = None,
                 run_as: RunAs = RunAs(), cgroups: NodeCgroups | None = None,
                 spare: Callable[[], set[int]] = set, rank_log_max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.command = command
        self.run_as = run_as  # the job's interpreter and user (agent.confinement.job_user)
        self.warm_socket = warm_socket  # the agent's warm server (agent.warm.server), if it runs one
        self.paths = paths
        self.stop_grace_seconds = stop_grace_seconds
        self.clock = clock
        self.state = WorkerState.LAUNCHING
        self.end: GroupEnd | None = None
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
        self.rank_pids: dict[int, int] = {}
        self.runner_pids: dict[int, int] = {}
        self.exited: dict[int, dict[str, Any]] = {}
        self._exited_at: dict[int, float] = {}  # when each rank's exit record was read
        self._in_log: set[int] = set()  # ranks whose runner said their output is all in their log
        self._faults = FaultInjector(command.faults, paths, self.owns, self.lose_node)
        self._oom = OomWatch()  # the kernel's out-of-memory kills from now on
        self._ranks = SpoolReader()
        self._spool = SpoolReader()
        self._proc: subprocess.Popen[bytes] | None = None
        self._launched_at = self._last_progress = clock()
        self._last_step: int | None = None
        self._hang_limit = HangLimit(command.hang_timeout_seconds)  # adaptive once steps are seen (agent/groups/hang.py)
        self._frozen = FrozenRanks()  # ranks whose pulse and CPU time stand still (agent/groups/hang.py)
        self._saving: set[str] = set()  # sources (ranks) in a checkpoint's blocking part
        self._progress_marks: dict[str, tuple[int, ...]] = {}
        # Per rank: events its writer could not write yet (a full disk), and events it dropped.
        self.spool_trouble: dict[str, tuple[int, int]] = {}
        self._marked_at: float | None = None  # the last change of any rank's progress mark
        self._ending: GroupEnd | None = None  # decided; waiting for the processes to go
        self._ending_at: float | None = None
        self._ending_rank: int | None = None  # the rank whose exit record decided it
        self._killed_at: float | None = None  # when the agent SIGKILLed the group
        self._kill_at: float | None = None
        self._pidfds: dict[int, int] = {}  # pid -> pidfd: torchrun's guard and the rank runners (agent.groups.wakeup)

    @property
    def live_ranks(self) -> int:
        return 0 if self.state.is_terminal else len(self.rank_pids) - len(self.exited)

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
                and self._output_in(failed_ranks, self.clock())):
            return WorkerState.FAILED.value
        if not self.state.is_terminal and self._ending is None and self._ranks_succeeded:
            return WorkerState.SUCCEEDED.value
        return self.state.reported

    @property
    def _ranks_succeeded(self) -> bool:
        return self._all_exited and all(end_of_rank(r) is None for r in self.exited.values())

    @property
    def _all_exited(self) -> bool:
        return len(self.exited) == self.command.nproc_per_node

    def _output_in(self, ranks: set[int], now: float) -> bool:
        """Whether the output of these exited ranks is all in their logs: their runners said so or
        have exited (agent.launching.rank_runner), or they were waited for long enough."""
        return all(rank in self._in_log or self.runner_pids.get(rank) not in self._pidfds
                   or now - self._exited_at[rank] >= OUTPUT_WAIT_SECONDS for rank in ranks)

    def start(self) -> None:
        """Starts torchrun's guard, puts it into the attempt's cgroup, then lets it go on."""
        if self.cgroups is not None and self.run_as.user is not None:
            user = self.run_as.user
            self.cgroup = self.cgroups.attempt(user.uid, user.gid, self.marker)
        go_read, go_write = os.pipe()
        try:
            with open(os.open(self.paths.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as log_file:
                self._proc = subprocess.Popen(
                    torchrun_argv(self.command, self.paths, self.run_as.python, go_read, self.rank_log_max_bytes),
                    env=worker_env(self.command, self.paths, self.marker, self.warm_socket, self.run_as, self.cgroup),
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, pass_fds=(go_read,),
                    start_new_session=True, **self.run_as.popen(),
                )  # fmt: skip
            if self.cgroup is not None:
                (self.cgroup / PROCS).write_text(str(self._proc.pid))
            os.write(go_write, b"1")
        finally:
            os.close(go_read)
            os.close(go_write)  # unwritten: the guard starts nothing and exits
        self._launched_at = self._last_progress = self.clock()
        self._watch(self._proc.pid)
        self.events.emit("workers_launched", {
            "node_rank": self.command.node_rank, "nproc_per_node": self.command.nproc_per_node,
            "pid": self._proc.pid, "argv": rank_argv(self.command, self.run_as.python),
        })  # fmt: skip
        log.info("attempt %s/%d launched (guard pid %d)", self.command.job_id, self.command.attempt, self._proc.pid)

    def stop(self, reason: str, failure: GroupEnd | None = None) -> None:
        """SIGTERM to the group, SIGKILL after the grace. `failure`: the stop ends the attempt as
        this failure (Slurm's time limit or preemption) rather than as stopped."""
        if not self.state.is_terminal and self._proc is not None:
            self._read_rank_records(self.clock())  # a rank that already failed here is the cause, not the stop
        if self.state.is_terminal or self._ending is not None or self._proc is None:
            return  # already ending: the first cause stands
        self._ending = failure or GroupEnd(WorkerState.STOPPED, None, f"stopped: {reason}" if reason else "stopped")
        self.state = WorkerState.STOPPING
        signal_group(self._proc.pid, SIGTERM)  # torchrun passes it on to the ranks
        self._kill_at = self.clock() + self.stop_grace_seconds

    def poll(self) -> bool:
        """Looks at the group once without blocking; True when its state changed."""
        if self.state.is_terminal or self._proc is None:
            return False
        before = self.state
        now = self.clock()
        self._forget_exited()  # before the records: a runner writes its record, then exits
        self._read_rank_records(now)
        self._read_progress(now)
        if self._proc.poll() is not None:
            self._finish()
        elif self._kill_at is not None and now >= self._kill_at:
            self.kill()
        elif self._ending is None and not self._all_exited:
            self._check_hang(now)
        return self.state != before

    def kill(self) -> None:
        """SIGKILL to every process of the group; poll() then sees torchrun gone."""
        self._kill_at, self._killed_at = None, self.clock()
        if self._proc is not None:
            signal_group(self._proc.pid, SIGKILL)
        signal_marked(GROUP_MARKER_ENV, self.marker, SIGKILL)
        if self.cgroup is not None:
            kill_cgroup(self.cgroup)

    def lose_node(self) -> None:
        """The `lose_node` drill: this node goes as a dead machine would. Every process of the group,
        the job's node-local checkpoints (its snapshots and the copies it kept for peers), then the
        agent itself, SIGKILLed: no report, no goodbye; its guard empties its cgroups, and the
        service learns of it from its peers' failure and the missing heartbeats."""
        log.warning("fault injection: losing this node (the ranks, the local checkpoints, the agent)")
        self.kill()
        self.remove_local_checkpoints()
        os.kill(os.getpid(), SIGKILL)

    def remove_local_checkpoints(self) -> None:
        """Removes the job's node-local checkpoint folder (the agent names it, in its own root). The
        job writes inside it: shutil.rmtree walks it by descriptors and follows no link in it
        (`shutil.rmtree.avoids_symlink_attacks` on Linux)."""
        if self.command.checkpoint.local_dir is not None:
            shutil.rmtree(self.command.checkpoint.local_dir, ignore_errors=True)

    def owns(self, pid: int) -> bool:
        """Whether `pid` is a process of this group, by the kernel's word (not the job's records):
        in its cgroup; without one, a process of the job's user (a warm-forked rank's environment
        in /proc is its server's, so the marker cannot say)."""
        if self.cgroup is not None:
            return pid in pids_in(self.cgroup)
        return process_uid(pid) == (self.run_as.user.uid if self.run_as.user is not None else os.geteuid())

    def _read_rank_records(self, now: float) -> None:
        for record in self._ranks.read(self.paths.ranks_file):
            rank = record.get("rank")
            if not isinstance(rank, int):
                continue
            if "pid" in record:
                pid, runner_pid = record["pid"], record.get("runner_pid")
                if isinstance(pid, int) and isinstance(runner_pid, int):  # only ever signalled if owns() says so
                    self.rank_pids[rank], self.runner_pids[rank] = pid, runner_pid
                    if self.owns(runner_pid):
                        self._watch(runner_pid)
                continue
            if record.get(OUTPUT_IN_LOG) is True:
                self._in_log.add(rank)
                continue
            record = {k: v for k, v in record.items() if k != "oom"}  # the kernel's word, not the job's
            if record.get("signal") == "SIGKILL" and rank in self.rank_pids:
                killed = self._oom.killed({self.rank_pids[rank]})  # by the out-of-memory killer? (agent/groups/oom.py)
                if killed:
                    record["oom"] = next(iter(killed.values()))
            self.exited[rank], self._exited_at[rank] = record, now
            self.events.emit("worker_exited", {k: v for k, v in record.items() if k in WORKER_EXITED_FIELDS})
            failure = end_of_rank(record)
            if failure is not None and self._ending is None:
                log.warning("attempt %s/%d: %s", self.command.job_id, self.command.attempt, failure.detail)
                self._ending, self._ending_at, self._ending_rank = failure, now, rank
                self._kill_at = now + self.stop_grace_seconds  # torchrun tears the rest down itself first
            elif failure is not None and self._is_root_cause(failure, now):
                log.warning("attempt %s/%d: %s, the cause of %s", self.command.job_id, self.command.attempt,
                            failure.detail, self._ending.detail if self._ending else "")
                self._ending, self._ending_rank = failure, rank
        if self.state == WorkerState.LAUNCHING and len(self.rank_pids) == self.command.nproc_per_node:
            self.state = WorkerState.RUNNING
        if self._all_exited and self._kill_at is None:
            self._kill_at = now + self.stop_grace_seconds  # torchrun should follow its ranks out
        if self._all_exited and self._ending is not None and self._output_in(set(self.exited), now):
            self._kill_at = now  # a failed or stopped group: nothing of torchrun's own teardown is needed

    def _is_root_cause(self, failure: GroupEnd, now: float) -> bool:
        """A rank SIGKILLed from outside (a fault, the kernel's out-of-memory killer) breaks its
        peers' collectives, and a peer's plain exit may be recorded a moment before its runner
        records the kill: the kill is the cause. Not once the agent itself has killed the group."""
        return (self._ending is not None and self._ending.state == WorkerState.FAILED and self._ending.cause == "exit"
                and failure.cause == "signal" and "SIGKILL" in failure.detail and self._killed_at is None
                and now - (self._ending_at or now) <= ROOT_CAUSE_SECONDS)

    def _read_progress(self, now: float) -> None:
        for path in sorted(self.paths.events_dir.glob(RANK_SPOOL_GLOB)):
            records = self._spool.read(path)
            if records:
                self._last_progress = now
            for record in records:
                kind, source = record.get("kind"), str(record.get("source"))
                if kind == "step" and source == "rank:0":
                    step = record.get("step")
                    if isinstance(step, int):
                        self._last_step = max(step, self._last_step or 0)
                elif kind == "ckpt_start":
                    self._saving.add(source)
                    self._hang_limit.save_started()
                elif kind in ("ckpt_staged", "ckpt_failed"):
                    self._saving.discard(source)
                elif kind == "train_end":
                    self._hang_limit.ended = True
        # Every rank's progress mark (ett/events.py, "<step> <beats> <unwritten> <dropped> <writing> <pulse>"):
        # nodes without rank 0 see no step events. A new step or beat is progress; a step above 0
        # is a step done; the next two say whether the rank's disk is full; the last whether it
        # writes a checkpoint in the background.
        writing = False
        for path in self.paths.events_dir.glob(PROGRESS_GLOB):
            mark = read_progress_mark(path)
            if mark is None:
                continue
            writing = writing or mark.writing
            self.spool_trouble[path.name] = (mark.unwritten, mark.dropped)
            rank = rank_of_progress_file(path.name)
            if rank is not None:
                vitals = cpu_and_state(self.rank_pids[rank]) if rank in self.rank_pids.keys() - self.exited else None
                self._frozen.observe(rank, mark.pulse, vitals[0] if vitals else None, now)
            if (mark.step, mark.beats) != self._progress_marks.get(path.name):
                self._progress_marks[path.name] = (mark.step, mark.beats)
                self._last_progress = self._marked_at = now
                if mark.step > 0:
                    self._last_step = max(mark.step, self._last_step or 0)
        self._hang_limit.set_writing(writing)
        if self._last_step is not None:
            self._hang_limit.stepped(self._last_step, now)
        self._hang_limit.saving = bool(self._saving)
        if self._last_step is not None and self._faults.pending and self._ending is None:
            self._faults.on_step(self._last_step, self.rank_pids, self.runner_pids)

    def _check_hang(self, now: float) -> None:
        if self.command.hang_timeout_seconds is None:  # the job turned hang detection off
            return
        phase = "init" if self._last_step is None else "train"
        if frozen := self._frozen_rank(now):
            waited, limit, detail = frozen
        elif self._last_step is None:
            # Liveness marks (ett's run.progress) before the first step restart the init timeout.
            since = max(self._launched_at, self._marked_at or 0.0)
            waited, limit = now - since, self.command.init_timeout_seconds
            detail = (f"no first step within the init timeout of {limit:g}s: no rank reported a step or progress "
                      "(a script reports them with ett's run.step and run.progress, docs/library.md; "
                      "hang_timeout_seconds = null turns hang detection off)")
        else:
            waited, limit = now - self._last_progress, self._hang_limit.seconds or 0.0
            ceiling = self.command.hang_timeout_seconds
            how = (f"adaptive: {limit:.2f}s from this attempt's step times, ceiling {ceiling:g}s"
                   if self._hang_limit.adaptive else f"hang timeout {limit:g}s")
            detail = f"no progress for {waited:.1f}s after step {self._last_step} ({how})"
        if waited < limit:
            return
        log.warning("attempt %s/%d: %s", self.command.job_id, self.command.attempt, detail)
        self.events.emit("hang_detected", {"phase": phase, "seconds_without_progress": round(waited, 3),
                                           "timeout_seconds": round(limit, 3)}, step=self._last_step)
        self._ending = GroupEnd(WorkerState.FAILED, "hang", detail)
        self.state = WorkerState.STOPPING
        self.kill()

    def _frozen_rank(self, now: float) -> tuple[float, float, str] | None:
        """(seconds, limit, detail) of a rank of this group that froze (agent/groups/hang.py), by the kernel's word."""
        for rank, seconds in sorted(self._frozen.frozen(now).items()):
            pid = self.rank_pids[rank]
            vitals = cpu_and_state(pid)
            if vitals is None or not self.owns(pid):
                continue
            how = "stopped" if vitals[1] in "Tt" else f"state {vitals[1]}"
            after = f"after step {self._last_step}" if self._last_step is not None else "before its first step"
            return seconds, FROZEN_SECONDS, (f"rank {rank} frozen {after}: its pulse and CPU time stood still for "
                                             f"{seconds:.1f}s (process {how})")
        return None

    @property
    def exit_fds(self) -> list[int]:
        """pidfds of the processes whose exit the monitor loop should wake for."""
        return list(self._pidfds.values())

    def _watch(self, pid: int) -> None:
        fd = open_pidfd(pid)
        if fd is not None:
            self._pidfds[pid] = fd

    def _forget_exited(self) -> None:
        for pid, fd in list(self._pidfds.items()):
            if self.state.is_terminal or exited(fd):
                os.close(self._pidfds.pop(pid))

    def _finish(self) -> None:
        assert self._proc is not None
        self._read_rank_records(self.clock())
        for rank in sorted(self.rank_pids.keys() - self.exited.keys()):
            # No record: the runner was SIGKILLed (by us or by its parent's death), and so was its rank.
            self.exited[rank], self._exited_at[rank] = {"rank": rank, "signal": "SIGKILL"}, self.clock()
            self.events.emit("worker_exited", self.exited[rank])
        leftovers = signal_marked(GROUP_MARKER_ENV, self.marker, SIGKILL)
        if leftovers:
            log.warning("attempt %s/%d: killed %d leftover processes", self.command.job_id, self.command.attempt,
                        leftovers)
        if self.cgroup is not None and self.cgroups is not None:
            self.cgroups.empty(self.cgroup, self.spare())
        self._oom.close()
        code = self._proc.returncode
        if self._ending is not None:
            self.end = self._ending
        elif code == 0 or self._ranks_succeeded:
            # Every rank here succeeded: torchrun's own end (its exit barrier across nodes) is not ours.
            self.end = GroupEnd(WorkerState.SUCCEEDED)
        else:
            self.end = GroupEnd(WorkerState.FAILED, "exit", f"torchrun exit code {code} (see {self.paths.log_file})",
                                code)
        self.state = self.end.state
        self._forget_exited()
        write_private(self.paths.ended_marker, self.state.value.encode())
        log.info("attempt %s/%d %s %s", self.command.job_id, self.command.attempt, self.state, self.end.detail)

