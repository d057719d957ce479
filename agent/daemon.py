"""The agent daemon: registers, heartbeats, carries out commands, watches groups, forwards events.

Threads, and why each exists:
- main: the monitor loop. It alone starts and signals processes (the kernel ties a child's
  parent-death signal to the thread that forked it, so that thread must live as long as we do);
  it never blocks: commands arrive through a queue, reports leave through the ReportBook. Between
  polls it sleeps until a command comes, a watched process exits or the period ends (agent.groups.wakeup).
- long-poll: heartbeats with ?wait=S, so commands arrive the moment the service queues them.
- reporter: a heartbeat at once whenever an attempt's state changes, not at the next period.
- forwarder: posts spooled events, and may sit in backoff while the service is down.
"""

import logging
import os
import queue
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from agent.client import ServiceClient
from agent.confinement.cgroups import NodeCgroups, agent_cgroup_name
from agent.confinement.job_user import JobUserError, make_passable, resolve_job_users
from agent.forwarding.forward import ForwardConfig, Forwarder
from agent.forwarding.log_shipper import LogShipper
from agent.groups.supervisor import Supervisor
from agent.groups.wakeup import Wakeup
from agent.node.health import HealthCheck
from agent.node.metrics import AgentStats, serve_metrics
from agent.settings import AgentSettings
from agent.slurm import allocation_problem, slurm_job_id, termination
from agent.warm.servers import SCRIPT_BASE_IMPORTS, WarmServers
from agent.warm.sockets import socket_folder
from ett.protocol import HEARTBEAT_RETRY_MAX_SECONDS
from ett.protocol.messages import IntervalCommand, LaunchCommand, WarmCommand, command_adapter

log = logging.getLogger(__name__)
# The servers ETT_AGENT_WARM_AT_START names, by their imports (None: the built-in trainer's).
WARMED_AT_START: dict[str, list[list[str] | None]] = {
    "trainer": [None], "scripts": [SCRIPT_BASE_IMPORTS], "both": [None, SCRIPT_BASE_IMPORTS], "none": [],
}


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.stats = AgentStats()
        self.client = ServiceClient(settings)
        # JobUserError (a ValueError naming the setting) when the settings name no usable user.
        self.job_users = resolve_job_users(settings.job_python, settings.job_user, settings.allow_root_jobs,
                                           settings.job_uid_base, settings.job_uid_count, settings.data_dir / "homes")
        if slurm_job_id() is not None and (problem := allocation_problem(settings.token_file, self.job_users)):
            raise JobUserError(problem)  # before it makes anything on the node; said in the allocation's output
        # Its placer (agent.confinement.placement) listens beside the warm servers' sockets, in a folder of root's.
        # What a job's uid owns in its own folders is never swept as leftovers (agent.confinement.uid_files).
        sockets = self._socket_folder()
        self.cgroups = (NodeCgroups(agent_cgroup_name(settings.name, settings.data_dir), sockets,
                                    (settings.data_dir, settings.local_checkpoint_root, settings.checkpoint_root))
                        if os.geteuid() == 0 else None)
        self.warm = WarmServers(settings.data_dir, ["trainer.train", "torch.distributed.run"], self.cgroups, sockets)
        self.health = HealthCheck(settings.health_check, settings.health_check_interval_seconds)
        self.supervisor = Supervisor(settings.spool_root, settings.name, settings.stop_grace_seconds,
                                     settings.local_checkpoint_root, self.warm if settings.warm_start else None,
                                     settings.checkpoint_root, self.job_users, self.cgroups,
                                     settings.rank_log_max_bytes, self.health,
                                     settings.node_loss_drills)  # fmt: skip
        self.forwarder = Forwarder(settings.spool_root, settings.data_dir, self.client.post_events, self.stats,
                                   ForwardConfig(settings.batch_max_events, settings.batch_max_age_seconds,
                                                 settings.retry_base_seconds, settings.retry_max_seconds,
                                                 settings.spool_max_bytes),
                                   LogShipper(settings.spool_root, settings.data_dir,
                                              self.client.post_logs))  # fmt: skip
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stopping = threading.Event()  # set by a signal: wind down
        self.wakeup = Wakeup()  # ends the monitor loop's pause early
        self.leaving = False  # SIGTERM or SIGINT: every heartbeat from now on says the node takes no work
        self._report_now = threading.Event()
        self._heartbeats_done = threading.Event()
        self._forwarding_done = threading.Event()

    def _socket_folder(self) -> Path:
        """Where the warm servers listen (agent.warm.sockets.socket_folder); said once here when it
        cannot be made, as every launch then starts fresh."""
        try:
            return socket_folder(self.settings.data_dir)
        except OSError as exc:
            log.warning("no folder for the warm servers' sockets (%s: %s): every launch here starts fresh (no warm "
                        "start); give the agent a shorter --data-dir", exc.filename, exc.strerror)
            return (self.settings.data_dir / "warm").resolve()

    def run(self) -> None:
        make_passable(self.settings.spool_root)  # whatever the umask: the job's user goes through them
        make_passable(self.settings.local_checkpoint_root)
        make_passable(self.settings.data_dir / "homes")
        preflight = self.job_users.preflight
        problem = preflight.problem([self.settings.spool_root.resolve(), self.settings.local_checkpoint_root])
        if problem is not None:
            raise SystemExit(f"ett agent: {problem}")
        users = self.job_users
        log.info("jobs run as %s with %s", users.fixed.name if users.fixed else
                 f"a uid per owner, {users.uid_base} + the owner's number", users.python)
        if self.settings.metrics_port:
            serve_metrics(self.stats, self.settings.metrics_port)
        self.supervisor.recover()
        if self.health.run() is not None:  # said at registration: no work comes until it passes
            log.warning("%s; this node takes no new work until it passes", self.health.problem)
        if self.supervisor.warm is not None and self.job_users.fixed is not None:
            for imports in WARMED_AT_START[self.settings.warm_at_start]:
                self.warm.for_user(preflight, imports).ensure_running()  # their imports overlap registration
        if not self._register():
            self.warm.stop()
            return
        threads = [
            threading.Thread(target=self._long_poll, name="long-poll", daemon=True),
            threading.Thread(target=self._report_changes, name="reporter", daemon=True),
            threading.Thread(target=self.forwarder.run, args=(self._forwarding_done,), name="forwarder"),
            threading.Thread(target=self.health.run_every_interval, args=(self._heartbeats_done,), name="health",
                             daemon=True),
        ]  # fmt: skip
        for thread in threads:
            thread.start()
        self._report_now.set()  # the attempts a previous run left (Supervisor.recover) wait for their events
        try:
            self._monitor()
        finally:
            self._report_now.set()  # a leaving node is out of the scheduler's choice at once
            # In a Slurm allocation the ranks got SIGTERM too, and save a final checkpoint in the
            # grace: the attempt ends with Slurm's cause (agent/slurm.py), not as a plain stop.
            slurm_job = slurm_job_id() if self.leaving else None
            self.supervisor.shutdown(termination(slurm_job) if slurm_job else None)
            self.warm.stop()
            self._heartbeats_done.set()
            self._report_now.set()
            self._send_heartbeat(wait=0)  # the stopped attempts, said once more on the way out
            self._forwarding_done.set()
            self.forwarder.wake()  # out of a backoff: one last try
            threads[2].join(timeout=self.settings.request_timeout_seconds + 1)
            self.client.close()
            if self.cgroups is not None:
                self.cgroups.close()
            log.info("agent %s stopped", self.settings.name)

    def terminate(self) -> None:
        """What SIGTERM and SIGINT do (from a signal handler: flags only)."""
        self.leaving = True
        self.stopping.set()
        self.wakeup.wake()

    def _monitor(self) -> None:
        while not self.stopping.is_set():
            while not self.commands.empty():
                self._carry_out(self.commands.get_nowait())
            if self.supervisor.poll():
                self._report_now.set()
            if self.supervisor.warm is not None:
                self.warm.ensure_running()
            self.stats.processes = self.supervisor.live_ranks
            self.stats.rank_events_unwritten, self.stats.rank_events_dropped = (
                self.supervisor.rank_events_unwritten_and_dropped())
            if not self.stopping.is_set():
                self.wakeup.wait(self.settings.monitor_interval_seconds, self.supervisor.exit_fds)

    def _carry_out(self, payload: dict[str, Any]) -> None:
        try:
            command = command_adapter.validate_python(payload)
        except ValidationError as exc:
            log.error("command refused: %s: %s", payload.get("type"), exc)
            job_id, attempt = payload.get("job_id"), payload.get("attempt")
            if payload.get("type") == "launch" and isinstance(job_id, str) and isinstance(attempt, int):
                self.supervisor.refuse(job_id, attempt, f"the agent refused the launch command: {exc}"[:512])
                self._report_now.set()
            return
        if isinstance(command, LaunchCommand):
            self.forwarder.launches.know(command)  # its world and secrets, before its ranks write a byte
            self.supervisor.launch(command)
        elif isinstance(command, IntervalCommand):
            self.supervisor.set_interval(command)
            return  # no attempt state changed
        elif isinstance(command, WarmCommand):  # from the monitor loop: it alone starts processes
            self.supervisor.prewarm(command)
            return
        else:
            self.supervisor.stop(command)
        self._report_now.set()

    def _register(self) -> bool:
        """Registers, retrying while the service is unreachable; False when told to stop first."""
        failures = 0
        while not self.stopping.is_set():
            try:
                self.client.register(self.settings.address, self.settings.slots, self.health.problem)
                log.info("agent %s registered with %s", self.settings.name, self.settings.service_url)
                return True
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code in (401, 403, 422):
                    raise SystemExit(f"ett agent: registration refused: {exc.response.text}") from exc
                log.warning("registration failed: %s", exc)
            except httpx.HTTPError as exc:
                log.warning("registration failed: %s", exc)
            failures += 1
            self.stopping.wait(self._backoff(failures))
        return False

    def _long_poll(self) -> None:
        while not self._heartbeats_done.is_set():
            started = time.monotonic()
            commands = self._send_heartbeat(wait=self.settings.heartbeat_wait_seconds)
            rest = self.settings.heartbeat_interval_seconds - (time.monotonic() - started)
            # Commands come in runs (a stop, then the next attempt's launch): after some, poll
            # again at once; the pause is for an answer that came early with nothing in it.
            if rest > 0 and not commands:
                self._heartbeats_done.wait(rest)

    def _report_changes(self) -> None:
        while True:
            self._report_now.wait()
            self._report_now.clear()
            if self._heartbeats_done.is_set():
                return
            reports = self.supervisor.reports
            held = reports.held()
            if held:
                # An end is reported once this node's events are in (ReportBook); else try again.
                # Those attempts' events only: another job's backlog does not hold their end.
                if self.forwarder.flush(self.settings.flush_before_report_seconds, held) or reports.overdue():
                    reports.release(held)
                else:
                    self._heartbeats_done.wait(0.25)
                    self._report_now.set()
            self._send_heartbeat(wait=0)

    def _send_heartbeat(self, wait: float) -> int:
        """One heartbeat; the number of commands its answer carried (0 as well when it failed)."""
        attempts = self.supervisor.reports.to_send()
        body = {"clock": time.time(), "attempts": [report.model_dump() for report in attempts],
                "stats": self.stats.heartbeat_figures(),
                "leaving": self.leaving, "health": self.health.problem}
        try:
            answer = self.client.heartbeat(body, wait)
        except httpx.HTTPStatusError as exc:
            self.stats.heartbeat_failures += 1
            log.warning("heartbeat refused: %s %s", exc.response.status_code, exc.response.text[:200])
            if exc.response.status_code == 404:  # the service forgot us (a new database): say hello again
                self._register()
            return 0
        except httpx.HTTPError as exc:
            self.stats.heartbeat_failures += 1
            log.warning("heartbeat failed: %s", exc)
            self._heartbeats_done.wait(min(self._backoff(self.stats.heartbeat_failures), HEARTBEAT_RETRY_MAX_SECONDS))
            return 0
        self.stats.last_heartbeat = time.time()
        self.supervisor.reports.acknowledge(attempts)
        commands = answer.get("commands", [])
        for command in commands:
            self.commands.put(command)
        if commands:
            self.wakeup.wake()
        return len(commands)

    def _backoff(self, failures: int) -> float:
        limit = min(self.settings.retry_max_seconds, self.settings.retry_base_seconds * 2 ** min(failures, 16))
        return limit / 2 + random.uniform(0, limit / 2)
