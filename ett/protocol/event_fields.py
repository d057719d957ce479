"""Each event kind's `data` fields (docs/events.md), typed once: the library's writer (ett/events.py),
the agent's (agent/groups/workers.py, agent/forwarding/stamp.py) and the service's own events
(service/jobs/) name them from here, and the service's ingest checks every event's `data` against
its kind's type (service/schemas/events.py).

A field named here must have its type. A `data` may hold others (a newer writer's, a simulated or
replayed timeline's): the service keeps them as they are; only a rank's own library refuses to
write a field its kind does not declare (ett/events.py). Standard library only, as the rest of
ett.protocol: the rank runner imports it fresh for every rank.
"""

from typing import Required, TypedDict

# -- from the ranks (`source: rank:N`) --------------------------------------------------------


class NoData(TypedDict, total=False):
    """init_end, restore_start, ckpt_start, ckpt_staged, train_end: no fields of their own."""


class InitStartData(TypedDict, total=False):
    pid: int


class RestoreEndData(TypedDict, total=False):
    # From a persistent checkpoint `local`, `persistent` or `mixed` (the tier whose files were read);
    # from the fast tier `local-snapshot` or `peer-snapshot`.
    source: str
    # Where the state and the checkpoint did not match: the first 20 keys of each, and how many.
    not_restored: list[str]  # saved, with no place in the state
    not_restored_count: int
    missing: list[str]  # in the state, not saved
    missing_count: int
    differed: list[str]  # differed between ranks when saved; one rank's copy restored
    differed_count: int
    # An elastic run's persistent checkpoint saved at another world size, resharded on load: that size.
    saved_world_size: int


class StepData(TypedDict, total=False):
    duration: Required[float]  # seconds
    tokens: int  # all ranks'
    loss: float | None  # null: a NaN or infinite loss, as the service stores it
    # Seconds of the step spent blocked on a save (run.checkpoint or run.wait_for_staging inside it,
    # as the built-in trainer waits for the copy in the step after a save): booked as checkpoint
    # time, never again as slow time (docs/ett.md, "Slow time").
    saving: float


class CkptCommittedData(TypedDict, total=False):
    path: str
    bytes: int
    differs_across_ranks: list[str]  # the first 20 keys of plain values that differed between ranks
    verified: bool  # the agent's word on the folder (agent/forwarding/stamp.py), never the rank's


class CkptFailedData(TypedDict, total=False):
    error: str


class StepTimingData(TypedDict, total=False):
    first_step: int
    steps: int
    duration: float  # the median step, seconds
    work: float  # the median seconds before the synchronisation mark (the step's end), less waits on collectives
    work_low: float  # the second-lowest
    total_steps: int  # where the script knows it


# -- from the agents (`source: node:NAME`) ----------------------------------------------------


class WorkersLaunchedData(TypedDict, total=False):
    node_rank: int
    nproc_per_node: int
    pid: int  # torchrun's guard
    argv: list[str]


class WorkerExitedData(TypedDict, total=False):
    """What a rank runner's exit record passes on (agent/launching/rank_runner.py)."""

    rank: int
    exit_code: int
    signal: str  # the signal's name: SIGKILL
    fault: str  # the injected fault that ended it: exit
    error: str  # why its program could not start
    oom: str  # the kernel's out-of-memory killer's words on it (the agent's, never the record's)


class HangDetectedData(TypedDict, total=False):
    phase: str  # init or train
    seconds_without_progress: float
    timeout_seconds: float


# -- from the service (`source: service`) -----------------------------------------------------


class AttemptAllocatedData(TypedDict, total=False):
    nodes: list[str]
    full_nodes: int  # an elastic job's full size where this attempt runs on fewer nodes
    slurm_job_id: str  # a Slurm job's (docs/slurm.md)
    slurm_nodes: list[str]


class AttemptFailedData(TypedDict, total=False):
    # exit, signal, hang, node_lost, straggler; from Slurm time_limit, preempted or terminated
    cause: str
    detail: str
    diagnosis: str  # why, from the evidence (docs/reliability.md, "Failure diagnosis")
    summary: str  # its one line


class AttemptStoppedData(TypedDict, total=False):
    reason: str


class JobFinishedData(TypedDict, total=False):
    state: str


class ElasticData(TypedDict, total=False):
    """Rank 0 of an elastic job's run (spec `elastic`), once it knows what it can keep the same at
    fewer ranks (docs/library.md, "Elastic jobs"): the service shrinks the job only to these."""

    world_sizes: Required[list[int]]  # the world sizes below the full one it can go on at, ascending
    full_world_size: Required[int]


class CheckpointIntervalData(TypedDict, total=False):
    interval_steps: int  # a running `auto` job's new interval
    from_step: int
    was: int


# Every kind's type; its keys are ett.protocol.EVENT_KINDS (tests/service/ingest/test_event_fields.py).
EVENT_FIELDS: dict[str, type] = {
    "init_start": InitStartData, "init_end": NoData, "restore_start": NoData, "restore_end": RestoreEndData,
    "step": StepData, "ckpt_start": NoData, "ckpt_staged": NoData, "ckpt_committed": CkptCommittedData,
    "ckpt_failed": CkptFailedData, "train_end": NoData, "step_timing": StepTimingData,
    "elastic": ElasticData, "workers_launched": WorkersLaunchedData, "worker_exited": WorkerExitedData, "hang_detected": HangDetectedData,
    "attempt_allocated": AttemptAllocatedData, "attempt_failed": AttemptFailedData,
    "attempt_stopped": AttemptStoppedData, "job_finished": JobFinishedData,
    "checkpoint_interval": CheckpointIntervalData,
}  # fmt: skip
# Each kind's field names, for a check that costs a set lookup.
FIELD_NAMES: dict[str, frozenset[str]] = {kind: frozenset(fields.__annotations__)
                                          for kind, fields in EVENT_FIELDS.items()}
