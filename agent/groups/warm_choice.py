"""Which warm server a launch forks from, and which a spare starts for a job's next attempt
(docs/agent.md, "Warm start")."""

import logging
from collections.abc import Iterable
from pathlib import Path

from agent.confinement.job_user import JobUserError, JobUsers, RunAs
from agent.groups.workers import WorkerGroup
from agent.launching.launch import starts_warm
from agent.warm.client import runs_script
from agent.warm.servers import SCRIPT_BASE_IMPORTS, WarmServer, WarmServers
from ett.protocol.messages import LaunchCommand, WarmCommand

log = logging.getLogger(__name__)


def server_imports(entrypoint: list[str] | None, warm_imports: list[str]) -> list[str] | None:
    """The imports of the server a job's launch forks from: a script's `warm_imports` (named or
    learned), else the base set every script loads; None: the trainer's server."""
    return (warm_imports or SCRIPT_BASE_IMPORTS) if entrypoint is not None else None


def launch_server(warm: WarmServers, command: LaunchCommand, run_as: RunAs) -> WarmServer | None:
    """The server this launch forks from, if it may: the one of its own imports (server_imports),
    started if it is not; while that one still imports, its user's base server for a script if that
    one already listens: a restart never waits on imports a ready server spares it (the script
    imports the rest itself). Asked again at every poll while the launch waits, so it forks from
    whichever listens first. Asked when the node runs no group: no server stopped here is in use."""
    if not starts_warm(command):
        return None
    server = warm.for_user(run_as, server_imports(command.entrypoint, command.warm_imports))
    server.ensure_running()
    if command.entrypoint is not None and (server.starting or not server.usable):
        base = warm.kept(run_as, SCRIPT_BASE_IMPORTS)
        if base is not None and base is not server and base.usable and base.listening:
            return warm.for_user(run_as, SCRIPT_BASE_IMPORTS)  # now the most recently used
    return server if server.usable else None


def spare_server(warm: WarmServers, command: WarmCommand, job_users: JobUsers) -> WarmServer | None:
    """Starts the server a job's next launch here would fork from (the service's word to a spare),
    as the user this agent would launch the job as (the launch's own mapping: its owner's number
    within this agent's range, or its fixed user), never one it would refuse; None when it starts none."""
    if command.entrypoint is not None and not runs_script(command.entrypoint):
        return None  # not a `python SCRIPT`: its launches start fresh
    try:
        run_as = job_users.run_as(command)  # a launch's own mapping: it reads the owner fields alone
    except (JobUserError, OSError) as exc:
        log.warning("job %s: no warm server started for its next attempt: %s", command.job_id, exc)
        return None
    server = warm.for_user(run_as, server_imports(command.entrypoint, command.warm_imports))
    server.ensure_running()
    log.info("job %s: warm server %s started here for its next attempt", command.job_id, server.socket_path.name)
    return server


def in_use(groups: Iterable[WorkerGroup]) -> frozenset[Path]:
    """The sockets of the warm servers these groups forked from: never stopped while they run (their
    keepers and ranks would go with them)."""
    return frozenset(group.warm_socket for group in groups if group.warm_socket is not None)
