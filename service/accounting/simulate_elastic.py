"""Elastic against waiting for a spare (`ett simulate --elastic-vs-waiting`): the same job, the same
failures, on a fleet with few spares, accounted by the real engine (docs/ett.md, "Reduced capacity").

The model: the job needs its full size N (FleetModel.nodes) for a fixed amount of work, `days` of
training at full size without a failure. The fleet holds N + `spares` nodes. Failures come as in
simulate.py, a Poisson process (mean FleetModel.mtbf_seconds) over the time an attempt holds its
nodes, and each takes its node out: it is a spare again `spare_wait_seconds` after it failed (its
repair). Both policies draw the same failure times, so they differ only where they act:

- waiting: a restart needs N free nodes; while fewer are free, the whole job idles (recovery in the
  accounting) until repairs return enough;
- elastic: a restart goes on at once on what is free, at least `min_nodes` (fewer: it waits too). At
  n of N nodes the global batch is kept, so a step takes N / n as long (productive at reduced
  capacity). After a spare returns, the attempt grows back at its next committed checkpoint: it is
  stopped there and the next attempt restores that checkpoint on the nodes then free.

Both pay the same restart (detection of a lost node, rescheduling, start-up, restore) and lose the
steps since the last committed checkpoint at a failure; growing back costs one more restart (it
always grows here: no cost model). Deterministic for a seed.
"""

import random
from dataclasses import dataclass
from typing import Any

from service.accounting.engine import Event
from service.accounting.memory import MemoryJob
from service.accounting.simulate import FleetModel, _Emitter

RANK0 = "rank:0"
START_TS = 1_700_000_000.0  # the simulated job's first allocation: the report depends on durations only


@dataclass(frozen=True)
class ElasticModel:
    fleet: FleetModel
    spares: int = 2
    spare_wait_seconds: float = 4 * 3600.0  # a failed node is a spare again this long after its failure
    min_nodes: int | None = None  # the elastic job's smallest size (None: half its nodes)

    def __post_init__(self) -> None:
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0, got {self.spares}")
        if not self.spare_wait_seconds >= 0:
            raise ValueError(f"spare_wait_seconds must be >= 0, got {self.spare_wait_seconds}")
        if not 1 <= self.floor <= self.fleet.nodes:
            raise ValueError(f"min_nodes must be between 1 and nodes ({self.fleet.nodes}), got {self.min_nodes}")

    @property
    def floor(self) -> int:
        return self.min_nodes if self.min_nodes is not None else max(1, self.fleet.nodes // 2)

    @property
    def target_step(self) -> int:
        """The job's work: `days` of steps at full size, in whole step events."""
        f = self.fleet
        return f.steps_per_event * max(1, round(f.days * 86400 / f.block_seconds))


@dataclass(frozen=True)
class Run:
    policy: str  # waiting or elastic
    report: dict[str, Any]
    reduced_attempts: int  # attempts on fewer nodes than the full size
    events: int


class _Attempt:
    """One attempt's events from its allocation: start-up, restore, steps and checkpoints, until the
    work is done, the failure at `fail_at`, or (`grow`) the first commit after which more nodes are free."""

    def __init__(self, out: _Emitter, m: ElasticModel, number: int, nodes: int, fail_at: float,
                 grow: list[float] | None) -> None:
        self.out, self.m, self.number, self.nodes, self.fail_at = out, m, number, nodes, fail_at
        self.grow = grow  # the repairs under way (when each node is a spare again), where it may grow
        self.pending: list[tuple[float, int]] = []  # (commit time, step) of staged checkpoints
        self.committed_now = False

    def emit(self, kind: str, t: float, step: int | None = None, **data: Any) -> None:
        self.out.emit(kind, t, self.number, RANK0, step, **data)

    def commit_until(self, now: float, committed: int | None) -> int | None:
        while self.pending and self.pending[0][0] <= now:
            at, step = self.pending.pop(0)
            self.emit("ckpt_committed", at, step, path=f"/ckpt/step-{step:08d}", bytes=0, verified=True)
            committed, self.committed_now = step, True
        return committed

    def more_nodes_free(self, t: float) -> bool:
        free = self.m.fleet.nodes + self.m.spares - sum(r > t for r in self.grow or ())
        return self.grow is not None and min(free, self.m.fleet.nodes) > self.nodes

    def run(self, t: float, committed: int | None) -> tuple[float, str, int | None]:
        """(when it ended, how: done, failed or grow, the newest committed step)."""
        f, limit = self.m.fleet, self.fail_at
        self.emit("init_start", t)
        if t + f.init_seconds >= limit:
            return limit, "failed", committed
        t += f.init_seconds
        self.emit("init_end", t)
        step = 0
        if committed is not None:
            self.emit("restore_start", t, committed)
            if t + f.restore_seconds >= limit:
                return limit, "failed", committed
            t += f.restore_seconds
            self.emit("restore_end", t, committed, source="persistent")
            step = committed
        block = f.block_seconds * f.nodes / self.nodes  # n nodes do the N nodes' global batch
        blocks = 0
        while step < self.m.target_step:
            if t + block > limit:
                return limit, "failed", self.commit_until(limit, committed)
            t, step, blocks = t + block, step + f.steps_per_event, blocks + 1
            committed = self.commit_until(t, committed)
            self.emit("step", t, step, duration=block, steps=f.steps_per_event)
            if self.committed_now and self.more_nodes_free(t):
                return t, "grow", committed
            self.committed_now = False
            if blocks % f.blocks_per_checkpoint == 0:
                self.emit("ckpt_start", t, step)
                if t + f.checkpoint_blocking_seconds > limit:
                    return limit, "failed", self.commit_until(limit, committed)
                t += f.checkpoint_blocking_seconds
                committed = self.commit_until(t, committed)
                self.emit("ckpt_staged", t, step)
                self.pending.append((t + f.checkpoint_write_seconds, step))
        self.emit("train_end", t, step)
        return t, "done", committed


def simulate_policy(m: ElasticModel, elastic: bool) -> Run:
    """The job under one policy, to the end of its work, and the engine's report of it."""
    f, full = m.fleet, m.fleet.nodes
    rng = random.Random(f.seed)  # the failures' gaps alone: both policies draw the same
    out = _Emitter(START_TS)
    repairs: list[float] = []  # when each node under repair is a spare again, in failure order
    t, held, number, committed, reduced = 0.0, 0.0, 0, None, 0
    next_failure = rng.expovariate(1.0 / f.mtbf_seconds)  # in time the job holds nodes
    while True:
        repairs = [r for r in repairs if r > t]
        while full + m.spares - len(repairs) < (m.floor if elastic else full):
            t = repairs.pop(0)  # the job stands still until a repair returns a node
        nodes = min(full, full + m.spares - len(repairs))
        reduced += nodes < full
        names = [f"sim-node-{i:05d}" for i in range(nodes)]
        shrunk = {"full_nodes": full} if nodes < full else {}
        out.emit("attempt_allocated", t, number, "service", nodes=names, **shrunk)
        attempt = _Attempt(out, m, number, nodes, t + next_failure - held, repairs if shrunk and elastic else None)
        start = t
        t, how, committed = attempt.run(t, committed)
        held += t - start
        if how == "done":
            out.emit("job_finished", t, number, "service", state="succeeded")
            break
        if how == "failed":
            next_failure = held + rng.expovariate(1.0 / f.mtbf_seconds)
            repairs.append(t + m.spare_wait_seconds)
            detect = f.detection_seconds("node_lost")
            out.emit("attempt_failed", t + detect, number, "service", cause="node_lost", detail="simulated node loss")
            t += detect + f.reschedule_seconds
        else:
            out.emit("attempt_stopped", t, number, "service", reason=f"growing back to {full} nodes")
            t += f.reschedule_seconds
        number += 1
    job = MemoryJob("elastic" if elastic else "waiting")
    job.ingest(Event(**e) for e in out.events)
    return Run("elastic" if elastic else "waiting", job.report(START_TS + t), reduced, len(out.events))


def elastic_vs_waiting(m: ElasticModel) -> tuple[Run, Run]:
    """(waiting, elastic) on the same failures."""
    return simulate_policy(m, elastic=False), simulate_policy(m, elastic=True)
