"""What each node of a new attempt is told to launch: its share of the ranks, the job's program and
owner, checkpoint folders and interval, timeouts and the faults meant for its ranks; and what the
spares that could take its next attempt are told to warm."""

from collections.abc import Sequence

from ett.protocol.messages import CheckpointSpec, Fault, LaunchCommand, TrainerSpec, WarmCommand
from service.jobs.checkpoints import job_checkpoint_dir, owner_area
from service.models import Attempt, AttemptNode, Job, Node
from service.settings import Settings

# Spares told to warm per attempt, at most: a node loss's restart takes the first idle ones by name
# (service/jobs/placement.py), one per lost node; each agent keeps a few servers, least recently used
# stopped first (agent.warm.servers, MAX_SERVERS).
WARM_SPARES_MAX = 4


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
        node_rank=share.node_rank, nnodes=spec.nodes, nproc_per_node=per_node,
        master_addr=attempt.master_addr, master_port=attempt.master_port,
        trainer=TrainerSpec(**spec.trainer.model_dump()), entrypoint=spec.entrypoint, env=spec.env,
        warm_imports=spec.warm_imports or job.learned_imports or [],
        checkpoint=checkpoint, hang_timeout_seconds=spec.hang_timeout_seconds,
        init_timeout_seconds=settings.init_timeout_seconds,
        faults=[Fault(**f.model_dump()) for f in spec.faults if f.attempt == attempt.number and first <= f.rank < last],
    )  # fmt: skip


def learn_imports(job: Job, imports: list[str]) -> None:
    """What a job's script imported in its first attempt that told (AttemptReport.imports): its next
    launches' warm imports, on every node (spares too), where its spec names none."""
    if imports and job.spec.entrypoint is not None and not job.spec.warm_imports and not job.learned_imports:
        job.learned_imports = list(imports)


def spare_warm_commands(job: Job, spares: Sequence[Node], owner_number: int) -> list[tuple[Node, WarmCommand]]:
    """For an attempt just started: the idle nodes that could take its next attempt (`spares`, able
    to run it, by name), each with what to warm for it: the server its launch there would fork from
    (its owner's, with its warm imports, named or learned; the trainer's for a trainer job). None
    for a job with `env`, which never starts warm."""
    spec = job.spec
    if spec.env:
        return []
    command = WarmCommand(
        type="warm", job_id=job.id, owner=job.owner, owner_number=owner_number, entrypoint=spec.entrypoint,
        warm_imports=(spec.warm_imports or job.learned_imports or []) if spec.entrypoint is not None else [],
    )  # fmt: skip
    chosen = sorted(spares, key=lambda node: node.name)[:min(spec.nodes, WARM_SPARES_MAX)]
    return [(node, command) for node in chosen]
