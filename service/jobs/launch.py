"""What each node of a new attempt is told to launch: its share of the ranks, the job's program and
owner, checkpoint folders and interval, timeouts and the faults meant for its ranks."""

from ett.protocol.messages import CheckpointSpec, Fault, LaunchCommand, TrainerSpec
from service.jobs.checkpoints import job_checkpoint_dir, owner_area
from service.models import Attempt, AttemptNode, Job
from service.settings import Settings


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
        warm_imports=spec.warm_imports,
        checkpoint=checkpoint, hang_timeout_seconds=spec.hang_timeout_seconds,
        init_timeout_seconds=settings.init_timeout_seconds,
        faults=[Fault(**f.model_dump()) for f in spec.faults if f.attempt == attempt.number and first <= f.rank < last],
    )  # fmt: skip
