"""The agents' event batches, written in groups: all batches that arrive while one group is
written go together in the next (group commit, as heartbeats are: service/jobs/heartbeats.py), in one
transaction of a fixed number of statements: the nodes, the attempts given to them, and one
ingestion (service/ingest/store.py) of all their events. A job that went past its bound on events
(service/ingest/bound.py) is stopped after that transaction, in one of its own (`over_bound`).

Under load a batch's time went to waiting for its fifteen or so database round trips (each a
wake-up of PostgreSQL and of a worker thread on a busy machine) and for a thread, not to
ingestion's own work; a group shares them. Each batch still gets its own answer: its counts, or
its 403/404/422. A group that fails is written again one batch at a time, so an error, and the
nothing-stored of a rejected batch, stay with the batch that caused them.
"""

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

import anyio
from sqlalchemy import Row, bindparam, select
from sqlalchemy.orm import Session, sessionmaker

from service.agents.nodes import claimed_node
from service.group_commit import GroupWriter
from service.ingest.store import EventRejected, ingest
from service.models import JOB_WORLD_SIZE, Attempt, AttemptNode, Job, Node, Token
from service.outcomes import Forbidden, Refused, Unprocessable
from service.schemas.events import AgentEventIn, IngestOut
from service.security import Caller
from service.settings import Settings

log = logging.getLogger("ett.events")

Outcome = IngestOut | Exception
NodeLike = Node | Row  # a node's row, or (a batch refused at first, then found) its ORM object
Given = tuple[int, str, int]  # (node id, job id, attempt): an attempt given to a node


def _refused(item: "Posted", error: Exception) -> Exception:
    """A batch whose write failed alone: a 422 when one of its events is unacceptable."""
    if isinstance(error, EventRejected):
        return unprocessable(error)
    log.error("event batch of %s not stored", item.name, exc_info=error)
    return error


def unprocessable(rejected: EventRejected) -> Unprocessable:
    """The answer to a batch that one event makes unacceptable: 422 naming the event and field."""
    return Unprocessable(rejected.field, rejected.msg)


@dataclass
class Posted:
    name: str
    caller: Caller
    events: list[AgentEventIn]
    answer: asyncio.Future[IngestOut]


class EventBatchWriter:
    """Collects the agents' batches on the event loop; one lane of group commit
    (service/group_commit.py) writes them in groups on a worker thread of its own (so they never
    queue behind other requests for one)."""

    def __init__(
        self, sessions: sessionmaker[Session], settings: Settings, max_batches: int = 256, pace: float = 0.025,
        over_bound: Callable[[Collection[str]], None] = lambda jobs: None,
    ) -> None:
        self.sessions, self.settings = sessions, settings
        # Stops the jobs past their bound (main.py: service/jobs/event_limit.py, which ingestion,
        # below the jobs' wing, cannot import). Not in the ingestion's transaction: stopping locks
        # the job's attempts and nodes, which the heartbeats lock before the accounting rows.
        self.over_bound = over_bound
        # In a checkpoint burst a batch waits about one pace for its group to start: in the load
        # bench, batch p99 was 67 to 105 ms at 35 ms and 54 to 99 ms at 25 ms, with the same CPU
        # between bursts (BENCHMARKS.md, "Load"). The heartbeats' pace is the same.
        self.lane = GroupWriter(self._write_group, anyio.CapacityLimiter(1), most=max_batches, pace=pace,
                                refused=_refused)  # fmt: skip

    async def store(self, name: str, caller: Caller, events: list[AgentEventIn]) -> IngestOut:
        """Stores an agent's batch whole (or raises its 403/404/422, nothing stored)."""
        item = Posted(name, caller, events, asyncio.get_running_loop().create_future())
        self.lane.put(item)
        return await item.answer

    async def run(self) -> None:
        """The writer's task (cancel to stop; batches still waiting then fail)."""
        await self.lane.run()

    def _write_group(self, group: list[Posted]) -> list[Outcome]:
        """Checks each batch, then ingests those that pass in one transaction; raises
        EventRejected if an event of one of them is unacceptable (nothing is then stored)."""
        over_bound: frozenset[str] = frozenset()
        with self.sessions() as session:
            outcomes: list[Outcome | None] = [None] * len(group)
            nodes = self._own_nodes(session, group, outcomes)
            strangers, worlds, fenced = self._not_given(session, group, nodes)
            batch, offsets, spans = [], [], {}  # spans: group index -> its events' range in `batch`
            dropped: dict[int, int] = {}  # group index -> its events of attempts its node was fenced from
            for i, item in enumerate(group):
                if outcomes[i] is not None:
                    continue
                node = nodes[i]
                refused = (_foreign_source(node, item.events) or strangers.get(i)
                           or _beyond_world(node, item.events, worlds))
                if refused is not None:
                    outcomes[i] = refused
                    continue
                # A node declared lost for an attempt (service/jobs/peer_loss.py) has its say on it no
                # more: what it sends of it late (a step, a checkpoint's commit) is refused, answered as
                # such so its forwarder goes on, and never a resume point.
                kept = item.events if not fenced else [e for e in item.events
                                                       if (node.id, e.job_id, e.attempt) not in fenced]
                dropped[i] = len(item.events) - len(kept)
                spans[i] = range(len(batch), len(batch) + len(kept))
                batch += [(e.job_id, e) for e in kept]
                offsets += [node.clock_offset_seconds] * len(kept)
            result = ingest(session, batch, clock_offsets=offsets, settings=self.settings) if batch else None
            if result is not None:
                session.commit()
            for i, span in spans.items():
                accepted = sum(k in result.stored for k in span) if result else 0
                past = sum(k in result.refused for k in span) if result else 0
                outcomes[i] = IngestOut(accepted=accepted, duplicates=len(span) - accepted - past,
                                        refused=past + dropped[i])
            over_bound = result.over_bound if result else frozenset()
        if over_bound:  # with the group's connection given back
            self._stop(over_bound)
        return outcomes  # type: ignore[return-value]  # every entry set above

    def _stop(self, jobs: Collection[str]) -> None:
        # The batches are stored and answered whatever becomes of this: the job's next batch, refused
        # too, tries again.
        try:
            self.over_bound(jobs)
        except Exception:
            log.exception("jobs %s past their bound on events not stopped", sorted(jobs))

    @staticmethod
    def _own_nodes(session: Session, group: list[Posted], outcomes: list[Outcome | None]) -> dict[int, NodeLike]:
        """Each batch's node, by group index, in one query; a batch refused (401/403/404) gets
        its outcome instead, the answer it would get alone."""
        found = {row.name: row for row in session.execute(_NODES, {"names": list({item.name for item in group})})}
        nodes: dict[int, NodeLike] = {}
        for i, item in enumerate(group):
            node = claimed_node(session, found.get(item.name), item.name, item.caller)
            if isinstance(node, Refused):
                outcomes[i] = node
            else:
                nodes[i] = node
        return nodes

    @staticmethod
    def _not_given(
        session: Session, group: list[Posted], nodes: dict[int, NodeLike]
    ) -> tuple[dict[int, Refused], dict[Given, int], set[Given]]:
        """The 403 of each batch with an event of an attempt the scheduler did not give its node, the
        number of ranks of each attempt given, and those its node was fenced from. Events of unknown
        jobs are left to ingestion, which refuses them with 422 naming the field."""
        jobs = list({e.job_id for i in nodes for e in group[i].events})
        if not jobs:
            return {}, {}, set()
        rows = session.execute(_GIVEN, {"nodes": list({n.id for n in nodes.values()}), "jobs": jobs}).all()
        given = {(row.node_id, row.job_id, row.number): row.world for row in rows}
        fenced = {(row.node_id, row.job_id, row.number) for row in rows if row.fenced_at is not None}
        known: set[str] | None = None  # read only when some attempt was not given: rarely
        refused = {}
        for i, node in nodes.items():
            events = group[i].events
            # A batch names one or two attempts in its hundreds of events: check those first.
            if all((node.id, job_id, attempt) in given for job_id, attempt in {(e.job_id, e.attempt) for e in events}):
                continue
            if known is None:
                known = set(session.scalars(_KNOWN_JOBS, {"jobs": jobs}))
            for k, e in enumerate(events):
                if e.job_id in known and (node.id, e.job_id, e.attempt) not in given:
                    refused[i] = Forbidden(f"events.{k}: attempt {e.attempt} of job {e.job_id} was not given to "
                                           f"agent {node.name}; it may report only its own attempts")
                    break
        return refused, given, fenced


# A group's statements, built once (built per group, each left cyclic garbage for the collector).
_NODES = (
    select(Node.id, Node.name, Node.token_id, Node.clock_offset_seconds, Token.revoked)
    .join(Token, Node.token_id == Token.id).where(Node.name.in_(bindparam("names", expanding=True)))
)  # fmt: skip
_KNOWN_JOBS = select(Job.id).where(Job.id.in_(bindparam("jobs", expanding=True)))
_GIVEN = (
    select(AttemptNode.node_id, Attempt.job_id, Attempt.number, JOB_WORLD_SIZE, AttemptNode.fenced_at)
    .join(AttemptNode).join(Job, Attempt.job_id == Job.id)
    .where(AttemptNode.node_id.in_(bindparam("nodes", expanding=True)),
           Attempt.job_id.in_(bindparam("jobs", expanding=True)))
)  # fmt: skip


def _beyond_world(node: NodeLike, events: list[AgentEventIn], worlds: dict[Given, int]) -> Unprocessable | None:
    """The 422 of a batch with an event of a rank its attempt does not have (the forwarder takes a
    rank's number from a file name the job can lay)."""
    for i, e in enumerate(events):
        if e.source[:5] == "rank:":
            world = worlds.get((node.id, e.job_id, e.attempt))
            if world is not None and int(e.source[5:]) >= world:
                return Unprocessable(f"events.{i}.source", f"{e.source} does not exist in attempt {e.attempt} of job "
                                     f"{e.job_id}: its ranks are 0 to {world - 1} (nodes x procs_per_node)")
    return None


def _foreign_source(node: NodeLike, events: list[AgentEventIn]) -> Unprocessable | None:
    """The 422 of a batch with an event from neither the node's ranks nor the node itself."""
    for i, e in enumerate(events):
        if not (e.source.startswith("rank:") or e.source == f"node:{node.name}"):
            return Unprocessable(f"events.{i}.source", f"agent {node.name} may send only its ranks' events and "
                                 f"node:{node.name}'s, not {e.source}'s")
    return None
