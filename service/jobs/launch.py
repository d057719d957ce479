"""A new attempt, allocated: what each of its nodes is told to launch (its share of the ranks, the job's
program and owner, checkpoint folders and interval, timeouts and the faults meant for its ranks); and
what the spares that could take its next attempt are told to warm."""

from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from itertools import islice

from sqlalchemy import select
from sqlalchemy.orm import Session, contains_eager

from ett.protocol.event_fields import AttemptAllocatedData
from ett.protocol.messages import CheckpointSpec, Fault, LaunchCommand, TrainerSpec, WarmCommand, module_names
from service.agents import commands
from service.jobs.checkpoints import checkpoint_interval_steps, job_checkpoint_dir, newest_checkpoint, owner_area
from service.jobs.owners import number_owner, owner_numbers
from service.jobs.placement import assignable, may_take, straggler_avoided
from service.jobs.rendezvous import free_master_port
from service.jobs.service_events import emit
from service.models import ACTIVE_ATTEMPT_STATES, AgentCommand, Attempt, AttemptNode, Job, JobState, Node, NodeState
from service.models import utc_at
from service.settings import Settings

# Spares told to warm per attempt, at most: a node loss's restart takes the first idle ones by name
# (service/jobs/placement.py), one per lost node; each agent keeps a few servers, least recently used
# stopped first (agent.warm.servers, MAX_SERVERS).
WARM_SPARES_MAX = 4


def start_attempt(session: Session, settings: Settings, job: Job, nodes: Sequence[Node], now: float,
                   reason: str | None = None) -> None:
    """Allocates the attempt on `nodes` (fewer than the job's: an elastic job's, `reason` says why) and tells
    each its share; its spares are told what to warm by the same tick's warm_spares (below)."""
    number, full = len(job.attempts), job.spec.nodes
    attempt = Attempt(
        job=job, number=number, allocated_at=utc_at(now), master_addr=nodes[0].address,
        master_port=free_master_port(session, settings, nodes[0].address, job),
        resume_from=newest_checkpoint(session, job.id), full_nodes=full if len(nodes) < full else None,
    )  # fmt: skip
    for rank, node in enumerate(nodes):
        attempt.nodes.append(AttemptNode(node=node, node_rank=rank))
        node.state = NodeState.busy
    job.state, job.restarts, job.reason = JobState.running, number, reason
    session.add(attempt)
    session.flush()
    allocated = AttemptAllocatedData(nodes=[n.name for n in nodes])
    if attempt.full_nodes is not None:
        allocated |= AttemptAllocatedData(full_nodes=attempt.full_nodes)
    if job.slurm_allocations:  # where it runs in Slurm's terms too
        slurm = job.slurm_allocations[-1]
        allocated |= AttemptAllocatedData(slurm_job_id=slurm.slurm_job_id, slurm_nodes=slurm.slurm_nodes)
    emit(session, job.id, number, "attempt_allocated", now, allocated)
    interval = attempt.interval_steps = checkpoint_interval_steps(session, job, settings)
    owner = number_owner(session, job.owner)
    for share in attempt.nodes:
        commands.enqueue(session, share.node, launch_command(settings, job, attempt, share, interval, owner))


def launch_command(settings: Settings, job: Job, attempt: Attempt, share: AttemptNode, interval: int,
                   owner_number: int) -> LaunchCommand:
    spec = job.spec
    per_node = spec.procs_per_node
    first, last = share.node_rank * per_node, (share.node_rank + 1) * per_node
    checkpoint = CheckpointSpec(
        interval_steps=interval, keep=spec.checkpoint.keep, dir=job_checkpoint_dir(settings, job),
        snapshots=spec.checkpoint.snapshots, snapshot_copies=spec.checkpoint.snapshot_copies,
        area=str(owner_area(settings, job.owner)), resume_from=attempt.resume_from,
    )  # fmt: skip
    return LaunchCommand(
        type="launch", job_id=job.id, attempt=attempt.number, owner=job.owner, owner_number=owner_number,
        # An elastic job's smaller attempt runs on its own nodes and says its full size (docs/library.md).
        node_rank=share.node_rank, nnodes=len(attempt.nodes), full_nnodes=attempt.full_nodes, nproc_per_node=per_node,
        master_addr=attempt.master_addr, master_port=attempt.master_port,
        trainer=TrainerSpec(**spec.trainer.model_dump()), entrypoint=spec.entrypoint, env=spec.env,
        warm_imports=warm_imports(job),
        checkpoint=checkpoint, hang_timeout_seconds=spec.hang_timeout_seconds,
        init_timeout_seconds=settings.init_timeout_seconds,
        faults=[Fault(**f.model_dump()) for f in spec.faults if f.attempt == attempt.number and first <= f.rank < last],
    )  # fmt: skip


def warm_imports(job: Job) -> list[str]:
    """What a job's launches warm: its spec's `warm_imports` (checked at submit), else what its first
    attempt learned, checked again here: a list stored before a name was refused must not reach a
    launch, nor stop every scheduler pass at a WarmCommand it cannot make."""
    return job.spec.warm_imports or module_names(job.learned_imports or [])


def learn_imports(job: Job, imports: list[str]) -> None:
    """What a job's script imported in its first attempt that told (AttemptReport.imports): its next
    launches' warm imports, on every node (spares too), where its spec names none."""
    if imports and job.spec.entrypoint is not None and not job.spec.warm_imports and not job.learned_imports:
        job.learned_imports = list(imports)


def spare_warm_commands(job: Job, spares: Sequence[Node], owner_number: int) -> list[tuple[Node, WarmCommand]]:
    """For a running attempt: the idle nodes that could take its next attempt (`spares`, able to run
    it, by name), each with what to warm for it: the server its launch there would fork from
    (its owner's, with its warm imports, named or learned; the trainer's for a trainer job). None
    for a job with `env`, which never starts warm."""
    spec = job.spec
    if spec.env:
        return []
    command = WarmCommand(
        type="warm", job_id=job.id, owner=job.owner, owner_number=owner_number, entrypoint=spec.entrypoint,
        warm_imports=warm_imports(job) if spec.entrypoint is not None else [],
    )  # fmt: skip
    chosen = sorted(spares, key=lambda node: node.name)[:min(spec.nodes, WARM_SPARES_MAX)]
    return [(node, command) for node in chosen]


def warm_spares(session: Session, settings: Settings, now: float) -> None:
    """Each scheduler pass: every running attempt's spares (the first idle nodes by name that could take
    its next one, as spare_warm_commands chooses them) told what to warm, each once per attempt and
    command: every spare of an attempt just started, a node that turned idle after the attempt started,
    and every spare again once the job's imports are learned (in its first attempt, at its `ett.init`:
    its next one forks from them on a spare too). What was told is read from the commands queued since
    the attempt started (agent_commands): no state of its own, whichever service process ticks.

    It runs on the scheduler's path at every tick: a few queries whatever the number of running
    attempts, each attempt's spares picked in Python (placement.may_take) from one read of the idle nodes."""
    fresh = datetime.fromtimestamp(now, UTC) - timedelta(seconds=settings.heartbeat_timeout_seconds)
    idle = session.scalars(select(Node).where(*assignable(fresh)).order_by(Node.name)).all()
    if not idle:
        return  # a busy cluster's usual pass: nothing more read
    running = (Attempt.state.in_(ACTIVE_ATTEMPT_STATES), Job.state == JobState.running)
    attempts = session.scalars(
        select(Attempt).join(Job).where(*running).order_by(Attempt.id)
        # Its learned imports are what its spares warm: loaded here, not one query per job.
        .options(contains_eager(Attempt.job).undefer(Job.learned_imports))
    ).all()  # fmt: skip
    if not attempts:
        return
    own: dict[int, set[int]] = defaultdict(set)  # an attempt's idle nodes (a share ended): not its spares
    for attempt_id, node_id in session.execute(
            select(AttemptNode.attempt_id, AttemptNode.node_id).join(Attempt).join(Job)
            .where(*running, AttemptNode.node_id.in_(select(Node.id).where(*assignable(fresh))))):  # fmt: skip
        own[attempt_id].add(node_id)
    stragglers: dict[str, list[Attempt]] = defaultdict(list)  # the attempts placement.straggler_avoided reads
    for ended in session.scalars(select(Attempt).join(Job).where(Job.state == JobState.running,
                                                                 Attempt.cause == "straggler")):  # fmt: skip
        stragglers[ended.job_id].append(ended)
    chosen: list[tuple[Attempt, list[Node]]] = []
    for attempt in attempts:
        job = attempt.job
        if job.spec.env:
            continue  # never starts warm
        excluded = own[attempt.id] | straggler_avoided(stragglers[job.id])
        # The first by the database's order of names, as a restart takes them (free_spare_nodes' LIMIT before).
        spares = list(islice((node for node in idle if may_take(node, job, excluded)), WARM_SPARES_MAX))
        if spares:
            chosen.append((attempt, spares))
    if not chosen:
        return
    owners = owner_numbers(session, {attempt.job.owner for attempt, _ in chosen})
    wanted = [(attempt, node, command) for attempt, spares in chosen
              for node, command in spare_warm_commands(attempt.job, spares, owners[attempt.job.owner])]  # fmt: skip
    since = min(attempt.allocated_at for attempt, _, _ in wanted)
    told = session.execute(select(AgentCommand.node_id, AgentCommand.payload, AgentCommand.created_at).where(
        AgentCommand.node_id.in_({node.id for _, node, _ in wanted}), AgentCommand.created_at >= since)).all()
    for attempt, node, command in wanted:
        payload = command.model_dump(mode="json")
        if not any(n == node.id and p == payload and at >= attempt.allocated_at for n, p, at in told):
            commands.enqueue(session, node, command)
