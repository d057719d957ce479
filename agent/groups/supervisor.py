"""All worker groups of this node: launched as their owner's user, in cgroups of their own, stopped, polled."""

import logging
import os
import pwd
import sys
import time
from collections.abc import Callable
from pathlib import Path

from agent.confinement.cgroups import NodeCgroups
from agent.confinement.confine import launch_refusal
from agent.confinement.job_user import JobUser, JobUserError, JobUsers, RunAs
from agent.files.beneath import open_folder_beneath, read_beneath, replace_beneath
from agent.files.spool import AttemptPaths, write_private
from agent.groups.report_book import AttemptKey, ReportBook, attempt_report
from agent.groups.states import GroupEnd, WorkerState
from agent.groups.warm_choice import in_use, launch_server, spare_server
from agent.groups.workers import WorkerGroup
from agent.launching.launch import learns_imports
from agent.launching.rank_log import DEFAULT_MAX_BYTES
from agent.node.health import HealthCheck
from agent.warm.learned import NotImports, read_learned_imports
from agent.warm.servers import WarmServer, WarmServers
from ett.protocol import CONTROL_DIR, EXIT_CONFIG_ERROR, IMPORTS_FILE, INTERVAL_FILE
from ett.protocol.messages import IntervalCommand, LaunchCommand, StopCommand, WarmCommand

log = logging.getLogger(__name__)
INTERVAL_FILE_MAX_BYTES = 1 << 20  # a line per change: far less in any real job
WARM_WAIT_SECONDS = 30.0  # the longest a trainer launch waits for the warm server's imports


def strictly_below(path: str, folder: str) -> bool:
    """`path`, as written, names a folder below `folder` (no link is resolved: make_own walks it)."""
    below = Path(os.path.normpath(path))
    return below != Path(folder) and below.is_relative_to(folder)


class Supervisor:
    def __init__(
        self, spool_root: Path, node_name: str, stop_grace_seconds: float, local_checkpoint_root: Path | None = None,
        warm: WarmServers | None = None, checkpoint_root: Path | None = None, job_users: JobUsers | None = None,
        cgroups: NodeCgroups | None = None, rank_log_max_bytes: int = DEFAULT_MAX_BYTES,
        health: HealthCheck | None = None, node_loss_drills: bool = False,
    ) -> None:
        self.spool_root = spool_root
        # Node-local fast checkpoint folders, one per job, kept across its attempts (None: no local tier).
        self.local_checkpoint_root = local_checkpoint_root
        self.warm = warm  # the job users' warm servers (agent.warm.server); None: every rank starts fresh
        self.checkpoint_root = checkpoint_root  # where jobs' checkpoint folders may be (agent/confinement/confine.py)
        # Who runs each launch, with which interpreter (agent/confinement/job_user.py); default: as the agent.
        self.job_users = job_users or JobUsers(sys.executable, JobUser.of(pwd.getpwuid(os.geteuid())))
        self.cgroups = cgroups  # each attempt's own (agent.confinement.cgroups); None: the marker scan only
        self.rank_log_max_bytes = rank_log_max_bytes
        self.health = health  # the operator's node check, run again before each launch (agent/node/health.py)
        self.node_loss_drills = node_loss_drills  # a job's lose_node fault may end this agent
        self.node_name = node_name
        self.stop_grace_seconds = stop_grace_seconds
        self.groups: dict[AttemptKey, WorkerGroup] = {}
        # Launches held back while a group of this node is still being torn down (a failure is
        # reported before its processes are gone), so an attempt never starts beside the last one.
        self.held: dict[AttemptKey, tuple[LaunchCommand, float]] = {}
        self.reports = ReportBook()
        # What each running script had imported at its `ett.init` (agent/warm/learned.py), once read; [] when
        # its file was no list: its ending report tells the service, for the job's next launches.
        self.learned: dict[AttemptKey, list[str]] = {}

    @property
    def live_ranks(self) -> int:
        return sum(group.live_ranks for group in self.groups.values())

    @property
    def exit_fds(self) -> list[int]:
        """pidfds of every group's processes: the monitor loop wakes when one exits (agent.groups.wakeup)."""
        return [fd for group in self.groups.values() for fd in group.exit_fds]

    def rank_events_unwritten_and_dropped(self) -> tuple[int, int]:
        """Over this node's running ranks: events waiting for disk space, and events dropped."""
        trouble = [t for group in self.groups.values() for t in group.progress.spool_trouble.values()]
        return sum(t[0] for t in trouble), sum(t[1] for t in trouble)

    def recover(self) -> None:
        """Reports the attempts a previous agent run left unfinished: their groups died with it,
        or die now (what escaped the parent-death signals is still in their cgroups)."""
        if self.cgroups is not None and (emptied := self.cgroups.empty_leftovers()):
            log.warning("emptied %d attempt cgroups a previous run of this agent left", emptied)
        for attempt_dir in sorted(self.spool_root.glob("*/*")):
            paths = AttemptPaths(attempt_dir)
            if not attempt_dir.name.isdigit() or paths.ended_marker.exists():
                continue
            end = GroupEnd(WorkerState.FAILED, "signal", "the agent restarted; its worker group was killed with it")
            write_private(paths.ended_marker, end.state.value.encode())
            job_id, attempt = attempt_dir.parent.name, int(attempt_dir.name)
            self.reports.set((job_id, attempt), attempt_report(job_id, attempt, end.state.value, end))
            log.warning("attempt %s/%d: %s", job_id, attempt, end.detail)

    def launch(self, command: LaunchCommand) -> None:
        if command.key in self.groups or command.key in self.held:
            log.info("attempt %s/%d already launched here; ignored", *command.key)
            return
        if self.groups:
            log.info("attempt %s/%d waits for the previous group of this node to be gone", *command.key)
            self.held[command.key] = (command, time.monotonic() + self.stop_grace_seconds + 5.0)
            return
        if self._waits_for_warm(command):
            log.info("attempt %s/%d waits for the warm server's imports", *command.key)
            self.held[command.key] = (command, time.monotonic() + WARM_WAIT_SECONDS)
            return
        self._start(command)

    def _warm_server(self, command: LaunchCommand, run_as: RunAs) -> WarmServer | None:
        """The warm server this launch forks from, if it may (agent.groups.warm_choice)."""
        return launch_server(self.warm, command, run_as) if self.warm is not None else None

    def prewarm(self, command: WarmCommand) -> None:
        """A spare starts a job's warm server; a node that runs or holds a launch is none (its CPUs are its ranks')."""
        if self.warm is not None and not self.groups and not self.held:
            spare_server(self.warm, command, self.job_users)

    def _waits_for_warm(self, command: LaunchCommand) -> bool:
        """Whether its user's warm server is still importing: a trainer launch then waits for it (at
        most WARM_WAIT_SECONDS) rather than start cold, which takes as long and loads the CPU twice."""
        try:
            server = self._warm_server(command, self.job_users.run_as(command))
        except (JobUserError, OSError):
            return False  # refused at its start
        return server is not None and server.starting

    def _start(self, command: LaunchCommand) -> None:
        try:
            refusal = launch_refusal(command, self.checkpoint_root, self.node_loss_drills)
            run_as = self.job_users.run_as(command)
        except (JobUserError, OSError) as exc:
            refusal, run_as = f"refused: {exc}", None
        if refusal is not None or run_as is None:
            log.warning("attempt %s/%d: %s", command.job_id, command.attempt, refusal)
            self.refuse(command.job_id, command.attempt, str(refusal), exit_code=EXIT_CONFIG_ERROR)
            return
        unhealthy = self.health.run() if self.health is not None else None
        if unhealthy is not None:  # the node's fault, not the job's: it restarts elsewhere
            log.warning("attempt %s/%d refused: %s", command.job_id, command.attempt, unhealthy)
            self.refuse(command.job_id, command.attempt, f"node unhealthy: {unhealthy}")
            return
        paths = AttemptPaths.of(self.spool_root, command.job_id, command.attempt)
        command = self._with_local_checkpoints(command)
        server = self._warm_server(command, run_as)
        warm_socket = server.socket_path if server is not None and not server.starting else None
        if warm_socket is not None and command.entrypoint is not None:  # the base server, or its imports' own
            log.info("attempt %s/%d forks from warm server %s", *command.key, warm_socket.name)
        try:  # its folders made: a disk full or a folder the job left in the way stays this launch's
            group = WorkerGroup(command, paths, self.node_name, self.stop_grace_seconds, warm_socket=warm_socket,
                                run_as=run_as, cgroups=self.cgroups,
                                spare=self.warm.pids if self.warm is not None else set,
                                rank_log_max_bytes=self.rank_log_max_bytes)  # fmt: skip
        except OSError as exc:
            log.warning("attempt %s/%d: launch failed: %s", command.job_id, command.attempt, exc)
            self.refuse(command.job_id, command.attempt, f"launch failed: {exc}")
            return
        self.groups[command.key] = group
        try:
            for folder, anchor in self._job_folders(command):  # its user's to write and prune
                run_as.make_own(folder, anchor)
            group.start()
        except OSError as exc:  # torchrun could not even be started
            group.end, group.state = GroupEnd(WorkerState.FAILED, "exit", f"launch failed: {exc}"), WorkerState.FAILED
        self._report(group)

    def _job_folders(self, command: LaunchCommand) -> list[tuple[str, str | None]]:
        """The job's checkpoint folders, each with the folder it is made from (make_own, which follows
        no link below it): the owner's area (checked at launch) or this agent's local root."""
        ckpt, local_root = command.checkpoint, self.local_checkpoint_root
        anchors = {ckpt.dir: ckpt.area, ckpt.local_dir: str(local_root) if local_root is not None else None}
        return [(folder, anchor if anchor is not None and strictly_below(folder, anchor) else None)
                for folder, anchor in anchors.items() if folder is not None]

    def _with_local_checkpoints(self, command: LaunchCommand) -> LaunchCommand:
        """The service knows no node's disks: the agent names the job's node-local folder."""
        ckpt = command.checkpoint
        if self.local_checkpoint_root is None or ckpt.dir is None or ckpt.local_dir is not None:
            return command
        local = ckpt.model_copy(update={"local_dir": str(self.local_checkpoint_root / command.job_id)})
        return command.model_copy(update={"checkpoint": local})

    def refuse(self, job_id: str, attempt: int, detail: str, exit_code: int | None = None) -> None:
        """A launch the agent could not read, or will not run, still gets an answer, so the
        service can move on. With the configuration error's exit code it does not retry."""
        end = GroupEnd(WorkerState.FAILED, "exit", detail, exit_code)
        self.reports.set((job_id, attempt), attempt_report(job_id, attempt, end.state.value, end))

    def set_interval(self, command: IntervalCommand) -> None:
        """Hands a running attempt's ranks their new checkpoint interval: added to the ones before
        (a change whose step has not come yet still holds until the next one's), written whole (a
        rename), read by each rank at its next step (ett/checkpoint.py, IntervalFile)."""
        group = self.groups.get(command.key)
        if group is None:
            log.info("checkpoint interval for attempt %s/%d, which does not run here; ignored", *command.key)
            return
        attempt = group.paths.root  # the job's: no link in it is followed (agent/files/beneath.py)
        try:
            control = open_folder_beneath(attempt.parent, Path(attempt.name) / CONTROL_DIR)
            try:
                earlier = read_beneath(control, INTERVAL_FILE, INTERVAL_FILE_MAX_BYTES)
                line = f"{command.interval_steps} {command.from_step}\n".encode()
                replace_beneath(control, INTERVAL_FILE, earlier + line)
            finally:
                os.close(control)
        except OSError as exc:
            log.warning("attempt %s/%d: checkpoint interval not handed over (%s in its control folder)",
                        *command.key, exc)
            return
        log.info("attempt %s/%d: checkpoint interval %d from step %d", *command.key, command.interval_steps,
                 command.from_step)

    def stop(self, command: StopCommand) -> None:
        if self.held.pop(command.key, None) is not None:  # never started: nothing to tear down
            self.reports.set(command.key, attempt_report(*command.key, WorkerState.STOPPED.value, None))
            return
        group = self.groups.get(command.key)
        if group is None:
            log.info("stop for attempt %s/%d, which does not run here; ignored", *command.key)
            return
        self._guarded(group, lambda: group.stop(command.reason, at_once=command.at_once))
        self._report(group)

    def poll(self) -> bool:
        """Polls every group once; True when an attempt's reported state changed."""
        changed = False
        for key, group in list(self.groups.items()):
            self._guarded(group, group.poll)
            learned = learns_imports(group.command) and key not in self.learned and self._learn_imports(group)
            if learned or (group.reported_state, group.outcome) != group.told:  # a cause may be corrected too
                self._report(group)
                changed = True
            if group.state.is_terminal:
                del self.groups[key]
                self.learned.pop(key, None)
            if group.state == WorkerState.SUCCEEDED:  # no attempt will resume from the local copies
                group.remove_local_checkpoints()
        for key, (command, deadline) in list(self.held.items()):
            free = not self.groups and not self._waits_for_warm(command)
            if free or time.monotonic() >= deadline:  # past the deadline, a stuck group is not waited for
                del self.held[key]
                self._start(command)
                changed = True
        return changed

    def shutdown(self, failure: GroupEnd | None = None) -> None:
        """Stops every group (SIGTERM, then SIGKILL after the grace) and waits for them to go.
        `failure`: what ends their attempts (Slurm's SIGTERM), instead of a plain stop."""
        for key in list(self.held):
            self.stop(StopCommand(type="stop", job_id=key[0], attempt=key[1], reason="agent shutting down"))
        for group in self.groups.values():
            self._guarded(group, lambda g=group: g.stop("agent shutting down", failure))
        deadline = time.monotonic() + self.stop_grace_seconds + 5.0
        while self.groups and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.05)
        for group in self.groups.values():
            group.kill()
        while self.groups and time.monotonic() < deadline + 5.0:
            self.poll()
            time.sleep(0.05)

    def _guarded(self, group: WorkerGroup, action: Callable[[], object]) -> None:
        """Does `action` on the group; whatever goes wrong there (its folders and files are its
        job's to fill) fails that attempt with the reason, never the agent or another job."""
        try:
            action()
        except Exception as exc:
            log.exception("attempt %s/%d: failed on what its job wrote", *group.command.key)
            group.fail_on_its_files(f"{type(exc).__name__}: {exc}")

    def _learn_imports(self, group: WorkerGroup) -> bool:
        """Reads what the group's script imported once its local rank 0 has written it, and starts a
        warm server of those imports now, for a restart to fork from once it listens (until then it
        forks from the base server); True when it learned some, which the next report carries (for the
        job's spares). Asked while the group runs, which may have been forked from the base server: the
        server it forked from is never the one stopped on the way (in_use)."""
        key = group.command.key
        try:
            names = read_learned_imports(group.paths)
        except (OSError, NotImports) as exc:  # the job's file: its next attempts start cold, the agent goes on
            log.warning("attempt %s/%d: its %s is not read: %s", *key, IMPORTS_FILE, exc)
            names = []
        if names is None:
            return False  # not written yet
        self.learned[key] = names
        if names and self.warm is not None:
            self.warm.for_user(group.run_as, names, in_use(self.groups.values())).ensure_running()
            log.info("attempt %s/%d: its script's %d imports learned; a warm server of them starts", *key, len(names))
        return bool(names)

    def _report(self, group: WorkerGroup) -> None:
        command = group.command
        imports = self.learned.get(command.key)  # while it runs too: said once (ReportBook.acknowledge)
        group.told = group.reported_state, group.outcome
        report = attempt_report(command.job_id, command.attempt, group.told[0], group.told[1], imports)
        self.reports.set(command.key, report)
