"""A heartbeat's answer, long-polled: the heartbeat is recorded with the others that arrive
meanwhile (service/jobs/heartbeats.py), then the answer waits until a command for the node is
queued or the agent's `wait` is over."""

import time

from fastapi.concurrency import run_in_threadpool

from service.agents import commands
from service.context import ServiceContext
from service.schemas.agents import Heartbeat, HeartbeatReply
from service.security import Caller


async def answer_heartbeat(
    context: ServiceContext, name: str, caller: Caller, beat: Heartbeat, wait: float
) -> HeartbeatReply:
    """A heartbeat's answer, after its checks: recorded with the others, then held up to `wait`
    seconds until a command for the node exists (long-poll). The route of service/api/agents.py
    and the fast lane of service/asgi/hot_paths.py both answer with it."""
    received = time.time()
    wait = min(wait, context.settings.max_heartbeat_wait_seconds)

    def take(node_id: int) -> list[dict]:
        with context.sessions() as session:
            # A read first: most polls find nothing, and need not queue for SQLite's write lock.
            if not commands.has_pending(session, node_id):
                return []
            taken = commands.take_pending(session, node_id)
            session.commit()
            return taken

    # Written with the other heartbeats that arrive meanwhile (HeartbeatWriter), commands included.
    node_id, pending = await context.heartbeats.record(name, caller, beat, received)
    # Only an attempt that ended may need the scheduler now (a restart, a finish): a busy node
    # lists its running attempt in every heartbeat, and waking on each would run it non-stop.
    if any(report.state != "running" for report in beat.attempts):
        context.wake_scheduler()
    deadline = time.monotonic() + wait
    while not pending and time.monotonic() < deadline:
        # No thread, no connection and no query while waiting: the bell rings when a command
        # for the node is queued, by this service process or (found within a second) another.
        if await context.bell.wait(node_id, deadline - time.monotonic()):
            pending = await run_in_threadpool(take, node_id)
    return HeartbeatReply(commands=pending, server_time=time.time())
