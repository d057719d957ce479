"""The fleet simulator: schema-v1 timelines of large jobs from a failure model, at simulated time.

The model (`FleetModel`), per attempt of the job:

    allocation -> init (I) -> restore of the newest committed checkpoint (S; none before the first
    commit) -> training: blocks of steps, and every K blocks a checkpoint that blocks training for
    C seconds (`ckpt_start` -> `ckpt_staged`) and is committed W seconds later in the background
    -> a failure, after an exponential time X (mean M) from the allocation -> detection (d, by
    cause) -> rescheduling (r) -> the next allocation.

So failures are a Poisson process over the time an attempt holds its nodes, and restarts cost
R = E[d] + r in recovery, I + S in start-up, and the steps since the last committed checkpoint.

Two tiers (`local_interval_seconds` > 0): every L seconds of training each rank also snapshots its
state on its node's local disk, a pause of `local_blocking_seconds` between steps (idle in the
accounting, as in a real job). A failure that keeps every node (a rank's exit, a hang) resumes
from the newest snapshot when it is newer than the newest committed checkpoint, in
`local_restore_seconds`; a lost node takes its snapshots with it, so that failure resumes from
the persistent tier; replicated (`local_replicated`), from the newest snapshot whose copy had
reached a peer (`replication_seconds` after it was taken), in `peer_restore_seconds`. Adaptive
detection: a hang caught after max(3 s, 4 steps), not the hang timeout (agent/groups/hang.py).
The job stops at the end of its wall budget (a failure whose restart would cross the end is not
simulated: the job stops there).

Aggregation: a step event every `steps_per_event` real steps (a "block" of B = steps_per_event *
step_seconds seconds), numbered with the real step count; 54 days of 10 s steps would otherwise
be 470,000 events. Only rank 0 and the service emit (docs/ett.md takes timings from rank 0), so
the 16,384 ranks of the default job add nothing to the accounting. Nothing sleeps: events carry
simulated timestamps, the last one at `end_ts`.

`expected_ett` gives the analytical ETT of the model (renewal-reward), `young_interval_seconds`
the interval Young's formula recommends.
"""

import math
import random
from dataclasses import dataclass, replace
from typing import Any

from service.accounting.engine import Event
from service.accounting.memory import MemoryJob

# Failure causes: (cause, share, detection seconds). The shares are illustrative, in the spirit
# of Llama 3's report (most interruptions are GPU or host faults that kill a rank, some lose a
# node, a few hang); detection: a dead rank at once, a silent node after the heartbeat timeout,
# a hang after the hang timeout.
CAUSES = (("exit", 0.78, 5.0), ("node_lost", 0.17, 15.0), ("hang", 0.05, 120.0))
ADAPTIVE_HANG_FLOOR_SECONDS, ADAPTIVE_HANG_STEPS = 3.0, 4.0  # agent/groups/hang.py
Trained = tuple[float, int | None, int | None, int]  # _train's: time, committed step, snapshot step, step


@dataclass(frozen=True)
class FleetModel:
    nodes: int = 2048
    gpus_per_node: int = 8
    days: float = 54.0
    mtbf_seconds: float = 54 * 86400 / 419  # Llama 3 405B: 419 unexpected interruptions in 54 days
    step_seconds: float = 10.0
    steps_per_event: int = 6
    checkpoint_interval_seconds: float = 1800.0  # of training: rounded to whole blocks
    checkpoint_blocking_seconds: float = 20.0
    checkpoint_write_seconds: float = 60.0  # the asynchronous rest, until committed
    init_seconds: float = 300.0
    restore_seconds: float = 120.0
    reschedule_seconds: float = 120.0
    local_interval_seconds: float = 0.0  # the node-local tier's interval of training; 0: one tier
    local_blocking_seconds: float = 0.5  # one snapshot's pause between steps: 5% of a step, the fast tier's budget
    local_restore_seconds: float = 10.0  # resuming from node-local snapshots
    local_replicated: bool = False  # each snapshot also kept on a peer node: node losses resume from it
    replication_seconds: float = 5.0  # a snapshot's copy reaches its peer this long after it is taken
    peer_restore_seconds: float = 30.0  # a lost node's replacement fetching its ranks' copies from the peers
    adaptive_detection: bool = False  # hangs caught after max(3 s, 4 steps), not the hang timeout
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("days", "mtbf_seconds", "step_seconds", "checkpoint_interval_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("checkpoint_blocking_seconds", "checkpoint_write_seconds", "init_seconds", "restore_seconds",
                     "reschedule_seconds", "local_interval_seconds", "local_blocking_seconds", "local_restore_seconds",
                     "replication_seconds", "peer_restore_seconds"):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.steps_per_event < 1 or self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("nodes, gpus_per_node and steps_per_event must be >= 1")

    @property
    def block_seconds(self) -> float:
        return self.steps_per_event * self.step_seconds

    @property
    def blocks_per_checkpoint(self) -> int:
        return max(1, round(self.checkpoint_interval_seconds / self.block_seconds))

    @property
    def interval_seconds(self) -> float:
        """The checkpoint interval actually simulated (whole blocks of steps)."""
        return self.blocks_per_checkpoint * self.block_seconds

    @property
    def blocks_per_snapshot(self) -> int:
        """Blocks of steps between node-local snapshots; 0: no local tier."""
        return max(1, round(self.local_interval_seconds / self.block_seconds)) if self.local_interval_seconds else 0

    def detection_seconds(self, cause: str) -> float:
        detect = dict((c, d) for c, _, d in CAUSES)[cause]
        if cause == "hang" and self.adaptive_detection:
            return min(detect, max(ADAPTIVE_HANG_FLOOR_SECONDS, ADAPTIVE_HANG_STEPS * self.step_seconds))
        return detect

    @property
    def restart_seconds(self) -> float:
        """R: mean detection plus rescheduling, from a failure to the next allocation."""
        return sum(share * self.detection_seconds(cause) for cause, share, _ in CAUSES) + self.reschedule_seconds


def llama3_405b(**overrides: Any) -> FleetModel:
    """16,384 GPUs in 2,048 nodes for 54 days with 419 unexpected interruptions."""
    return replace(FleetModel(), **overrides)


def expected_ett(m: FleetModel) -> float:
    """ETT (a fraction) of the model by renewal-reward, over cycles failure -> failure.

    A cycle is X + R, E = M + R. An attempt keeps T seconds of steps per checkpoint it commits;
    the k-th commits at s0 + k(T + C) + W after its allocation (s0 = I + S), so it is kept with
    probability P(X >= s0 + W + k(T + C)) = exp(-(s0 + W + k(T + C)) / M). Summing over k:

        ETT = T * exp(-(s0 + W) / M) / ((exp((T + C) / M) - 1) * (M + R))

    and to first order in 1/M:  ETT ~ 1 - C/T - (T/2 + C/2 + s0 + W + R) / M.
    Assumes every attempt restores (the first does not: a bias of one cycle in the job's) and
    ignores the steps after the last commit of the last attempt (kept, as the job ends).
    """
    T, C, W, M = m.interval_seconds, m.checkpoint_blocking_seconds, m.checkpoint_write_seconds, m.mtbf_seconds
    s0 = m.init_seconds + m.restore_seconds
    return T * math.exp(-(s0 + W) / M) / (math.expm1((T + C) / M) * (M + m.restart_seconds))


def young_interval_seconds(m: FleetModel) -> float:
    return math.sqrt(2.0 * m.checkpoint_blocking_seconds * m.mtbf_seconds)


def recommended_tiers(m: FleetModel) -> tuple[float, float]:
    """(local, persistent) intervals by Young's formula, each against the failures it covers: the
    persistent tier those that lose a node (share p), the local tier the others. To first order
    the two tiers then cost sqrt(2 c (1-p) / M) + sqrt(2 C p / M) of the time against one tier's
    sqrt(2 C / M), so a snapshot that costs more than about 40% of a persistent save (p = 0.17)
    does not pay: then the local interval is 0, one tier."""
    p = dict((cause, share) for cause, share, _ in CAUSES)["node_lost"]
    c, C, M = m.local_blocking_seconds, m.checkpoint_blocking_seconds, m.mtbf_seconds
    persistent = math.sqrt(2.0 * C * M / p)
    local = min(persistent, max(m.block_seconds, math.sqrt(2.0 * c * M / (1.0 - p))))
    pays = math.sqrt(c * (1.0 - p)) + math.sqrt(C * p) < math.sqrt(C)
    return (local, persistent) if pays and local < persistent else (0.0, young_interval_seconds(m))


def tier_models(m: FleetModel) -> dict[str, FleetModel]:
    """On the same failure times: the persistent tier only (Young's interval, the hang timeout);
    with node-local snapshots (recommended_tiers, adaptive detection); and with them replicated to
    a peer, covering node losses too (Young's interval against every failure; the persistent tier
    kept for a node lost with its peer)."""
    local, persistent = recommended_tiers(m)
    every_failure = max(m.block_seconds, math.sqrt(2.0 * m.local_blocking_seconds * m.mtbf_seconds))
    return {
        "persistent only": replace(m, checkpoint_interval_seconds=young_interval_seconds(m),
                                   local_interval_seconds=0.0, adaptive_detection=False),
        "local": replace(m, checkpoint_interval_seconds=persistent, local_interval_seconds=local,
                         adaptive_detection=True),
        "local replicated": replace(m, checkpoint_interval_seconds=persistent, local_replicated=True,
                                    local_interval_seconds=min(persistent, every_failure), adaptive_detection=True),
    }  # fmt: skip


class _Emitter:
    """Numbers events per (attempt, source), as the real emitters do."""

    def __init__(self, start_ts: float) -> None:
        self.events: list[dict[str, Any]] = []
        self.start_ts = start_ts
        self._seq: dict[tuple[int, str], int] = {}

    def emit(self, kind: str, t: float, attempt: int, emitter: str, step: int | None = None, **data: Any) -> None:
        seq = self._seq.get((attempt, emitter), 0)
        self._seq[(attempt, emitter)] = seq + 1
        self.events.append({"kind": kind, "ts": self.start_ts + t, "attempt": attempt, "source": emitter,
                            "seq": seq, "step": step, "data": data})  # fmt: skip


def simulate(m: FleetModel, end_ts: float) -> list[dict[str, Any]]:
    """The job's whole timeline as schema-v1 event dicts, ending at `end_ts` (unix seconds)."""
    rng = random.Random(m.seed)
    end = m.days * 86400.0
    out = _Emitter(end_ts - end)
    rank0 = "rank:0"
    t, attempt, committed, local, step = 0.0, 0, None, None, 0
    snapshots, from_peers = [], False  # (when taken, step) of the newest two snapshots; a lost node's, on its peers
    while True:
        out.emit("attempt_allocated", t, attempt, "service", node_count=m.nodes, gpus=m.nodes * m.gpus_per_node)
        fail_at = t + rng.expovariate(1.0 / m.mtbf_seconds)
        cause = rng.choices([c for c, _, _ in CAUSES], weights=[s for _, s, _ in CAUSES])[0]
        detect = m.detection_seconds(cause)
        if fail_at + detect + m.reschedule_seconds >= end:
            fail_at = math.inf
        limit = min(fail_at, end)
        out.emit("init_start", t, attempt, rank0)
        if t + m.init_seconds > limit:
            t = limit
        else:
            t += m.init_seconds
            out.emit("init_end", t, attempt, rank0)
            step = 0
            from_local = local is not None and local > (committed or 0)
            source, restore_to = ("local-snapshot", local) if from_local else ("persistent", committed)
            source = "peer-snapshot" if from_local and from_peers else source
            if restore_to is not None:
                out.emit("restore_start", t, attempt, rank0, restore_to)
                took = m.restore_seconds if not from_local else m.peer_restore_seconds if from_peers else \
                    m.local_restore_seconds
                if t + took <= limit:
                    t += took
                    out.emit("restore_end", t, attempt, rank0, restore_to, source=source)
                    step = restore_to
                    local = restore_to if from_local else None  # newer snapshots: an abandoned timeline
                    snapshots = [(t, restore_to)] if from_local else []  # on the nodes, and on their peers
                    from_peers = False
                else:
                    t = limit
            if t < limit:
                t, committed, local, step = _train(out, m, attempt, t, limit, committed, local, step, snapshots)
        if fail_at == math.inf:
            if step:
                out.emit("train_end", t, attempt, rank0, step)
            out.emit("job_finished", end, attempt, "service", state="succeeded")
            return out.events
        detail = f"simulated {cause} on sim-node-{rng.randrange(m.nodes):04d}"
        out.emit("attempt_failed", fail_at + detect, attempt, "service", cause=cause, detail=detail)
        if cause == "node_lost":  # the lost node's snapshots are gone; their copies on its peers are not
            arrived = [s for taken, s in snapshots if taken + m.replication_seconds <= fail_at]
            local = arrived[-1] if m.local_replicated and arrived else None
            from_peers = local is not None
        t, attempt = fail_at + detect + m.reschedule_seconds, attempt + 1


def _train(out: _Emitter, m: FleetModel, attempt: int, t: float, limit: float, committed: int | None,
           local: int | None, step: int, snapshots: list[tuple[float, int]]) -> Trained:
    """Blocks of steps, snapshots (appended to `snapshots`, the newest two kept) and checkpoints
    from t until `limit`; returns (time, committed step, snapshot step, step)."""
    rank0, B, C, W = "rank:0", m.block_seconds, m.checkpoint_blocking_seconds, m.checkpoint_write_seconds
    pending: list[tuple[float, int]] = []  # (commit time, step) of staged checkpoints
    blocks, every, snapshot_every = 0, m.blocks_per_checkpoint, m.blocks_per_snapshot

    def commit_until(now: float) -> None:
        nonlocal committed
        while pending and pending[0][0] <= now:
            at, s = pending.pop(0)
            out.emit("ckpt_committed", at, attempt, rank0, s, path=f"/ckpt/step-{s:08d}", bytes=0, verified=True)
            committed = s

    while t + B <= limit:
        t += B
        step += m.steps_per_event
        commit_until(t)
        out.emit("step", t, attempt, rank0, step, duration=B, steps=m.steps_per_event)
        blocks += 1
        if snapshot_every and blocks % snapshot_every == 0:
            if t + m.local_blocking_seconds > limit:
                break
            t += m.local_blocking_seconds  # between steps: idle in the accounting
            local = step
            snapshots[:] = [*snapshots[-1:], (t, step)]
        if blocks % every:
            continue
        out.emit("ckpt_start", t, attempt, rank0, step)
        if t + C > limit:
            break
        t += C
        commit_until(t)
        out.emit("ckpt_staged", t, attempt, rank0, step)
        pending.append((t + W, step))
    commit_until(limit)
    return t, committed, local, step


def memory_report(m: FleetModel, end_ts: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The timeline and the report the pure engine makes of it (no service)."""
    events = simulate(m, end_ts)
    job = MemoryJob("simulated")
    job.ingest(Event(**e) for e in events)
    return events, job.report(end_ts)


def sweep(m: FleetModel, intervals: list[float], end_ts: float) -> list[tuple[FleetModel, dict[str, Any]]]:
    """The model at each checkpoint interval and its report. The same seed gives every interval
    the same failure times (common random numbers), so the differences are mostly the interval's."""
    runs = []
    for interval in intervals:
        mi = replace(m, checkpoint_interval_seconds=interval)
        runs.append((mi, memory_report(mi, end_ts)[1]))
    return runs
