"""Elastic runs (ett/elastic.py, docs/library.md "Elastic jobs"): the plan's split of each step's
samples, its refusals, the `elastic` event; and examples/plain_ddp.py, real torchrun ranks on gloo,
shrunk from 2 ranks to 1 and grown back, against an uninterrupted 2-rank run."""

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ett.elastic import ElasticPlan
from ett.env import JobEnvironment
from ett.errors import UsageError
from ett.protocol import EVENTS_DIR, JobEnv, rank_spool
from ett.run import Run
from tests.support import warm
from tests.trainer.trainer_runs import REPO, kill_tree, read_events

PLAIN_DDP = REPO / "examples" / "plain_ddp.py"


def plans(global_batch: int, micro_batch: int, world_size: int, full_world_size: int) -> list[ElasticPlan]:
    return [ElasticPlan.declare(global_batch, micro_batch, world_size, full_world_size, rank)
            for rank in range(world_size)]


@pytest.mark.parametrize("global_batch, micro_batch, full", [(32, 4, 4), (24, 2, 6), (8, 8, 1), (12, 3, 2)])
def test_every_declared_size_trains_each_steps_samples_once_in_the_full_sizes_micro_batches(global_batch,
                                                                                            micro_batch, full):
    full_size = plans(global_batch, micro_batch, full, full)
    for size in [*full_size[0].world_sizes, full]:
        for step in (1, 2, 7):
            micro_batches = [m for plan in plans(global_batch, micro_batch, size, full)
                             for m in plan.sample_indices(step)]
            assert sorted(n for m in micro_batches for n in m) == list(range((step - 1) * global_batch,
                                                                             step * global_batch))
            assert all(len(m) == micro_batch for m in micro_batches)
            # The same micro batches as at full size, in the same order: a micro batch's mean loss is too.
            assert micro_batches == [m for plan in full_size for m in plan.sample_indices(step)]


def test_the_declared_sizes_are_those_below_the_full_one_where_each_rank_gets_whole_micro_batches():
    assert plans(48, 4, 6, 6)[0].world_sizes == [1, 2, 3, 4]
    assert plans(16, 8, 2, 2)[0].world_sizes == [1]
    assert plans(5, 5, 1, 1)[0].world_sizes == []
    one_of_two = plans(32, 8, 1, 2)[0]
    assert (one_of_two.accumulation_steps, one_of_two.micro_batches, one_of_two.slots) == (4, 4, [0, 1, 2, 3])
    # At full size without accumulation rank r takes every world_size-th sample, as DistributedSampler.
    assert plans(6, 3, 2, 2)[1].sample_indices(2) == [[7, 9, 11]]


def test_a_global_batch_that_cannot_split_is_refused_naming_it():
    with pytest.raises(UsageError, match="global_batch 30 does not split into micro batches of 4 over the full 2 "
                                         "ranks: make it a multiple of 8"):
        ElasticPlan.declare(30, 4, 2, 2, 0)
    with pytest.raises(UsageError, match="WORLD_SIZE 3 is not a size this run keeps its training at"):
        ElasticPlan.declare(16, 4, 3, 4, 0)
    with pytest.raises(UsageError, match="micro_batch must be an integer >= 1, got 0"):
        ElasticPlan.declare(16, 0, 1, 1, 0)
    with pytest.raises(UsageError, match="a step number is an integer >= 1"):
        ElasticPlan.declare(16, 4, 1, 1, 0).sample_indices(0)


def test_the_full_size_is_read_from_the_environment_and_below_the_present_one_refused():
    assert JobEnvironment.from_environ({"WORLD_SIZE": "2"}).full_world_size == 2
    assert JobEnvironment.from_environ({"WORLD_SIZE": "2", JobEnv.FULL_WORLD_SIZE: "4"}).full_world_size == 4
    with pytest.raises(UsageError, match=f"{JobEnv.FULL_WORLD_SIZE}: must be >= WORLD_SIZE \\(2\\), got 1"):
        JobEnvironment.from_environ({"WORLD_SIZE": "2", JobEnv.FULL_WORLD_SIZE: "1"})


def test_rank_0_says_its_sizes_once(tmp_path):
    env = JobEnvironment(job_id="job1", event_dir=str(tmp_path), full_world_size=4)
    run = Run(env)
    plan = run.elastic(global_batch=32, micro_batch=4)
    assert (plan.full_world_size, plan.world_size, plan.accumulation_steps) == (4, 1, 8)
    run.elastic(global_batch=32, micro_batch=4)
    run.close()
    elastic = [e for e in read_events(tmp_path / rank_spool(0)) if e["kind"] == "elastic"]
    assert [(e["step"], e["data"]) for e in elastic] == [(None, {"world_sizes": [1, 2], "full_world_size": 4})]


def plain_ddp(workdir: Path, ranks: int, steps: int, checkpoints: Path, full: int = 2) -> dict[int, float]:
    """examples/plain_ddp.py as one attempt of a job of `full` ranks run on `ranks`, to `steps` (its
    last step's checkpoint forced); rank 0's losses by step."""
    events = workdir / EVENTS_DIR
    env = {**os.environ, "ETT_JOB_ID": "elastic", "ETT_EVENT_DIR": str(events), "OMP_NUM_THREADS": "1",
           "ETT_CHECKPOINT_DIR": str(checkpoints), "ETT_CHECKPOINT_INTERVAL_STEPS": "1000",
           **({JobEnv.FULL_WORLD_SIZE: str(full)} if ranks < full else {})}  # fmt: skip
    # One rank is one process of its own (the script makes its one-rank group): no torchrun to start. Both forked
    # from the suite's warm server (tests/support/warm.py).
    command = [sys.executable, str(PLAIN_DDP), "--steps", str(steps), "--out", str(workdir / "final.pt")]
    workdir.mkdir(parents=True, exist_ok=True)
    with open(os.devnull, "w") as stdout, open(workdir / "stderr.log", "w") as stderr_file:
        if ranks > 1:
            process = warm.torchrun(ranks, command, workdir / "runners", REPO, env, stdout.fileno(), stderr_file.fileno())
        else:
            process = warm.start(command, REPO, env, stdout.fileno(), stderr_file.fileno())
    try:
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            kill_tree(process.pid)
            process.wait()
    stderr = (workdir / "stderr.log").read_text(errors="replace")
    assert process.returncode == 0, stderr[-3000:]
    by_kind: dict[str, list[dict]] = {}
    for event in read_events(events / rank_spool(0)):
        by_kind.setdefault(event["kind"], []).append(event)
    assert [e["data"] for e in by_kind["elastic"]] == [{"world_sizes": [1], "full_world_size": 2}]
    workdir.joinpath("restore_end.txt").write_text(repr([e["data"] for e in by_kind.get("restore_end", [])]))
    return {e["step"]: e["data"]["loss"] for e in by_kind["step"]}


def test_plain_ddp_shrunk_to_one_rank_and_grown_back_trains_as_the_uninterrupted_run(tmp_path):
    checkpoints = tmp_path / "ckpt"
    phases = [tmp_path / name for name in ("full", "shrunk", "grown")]
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(plain_ddp, tmp_path / "uninterrupted", 2, 18, tmp_path / "ckpt-uninterrupted")
        losses = plain_ddp(phases[0], 2, 6, checkpoints)
        losses |= plain_ddp(phases[1], 1, 12, checkpoints)
        losses |= plain_ddp(phases[2], 2, 18, checkpoints)
        expected = uninterrupted.result()
    assert sorted(losses) == sorted(expected) == list(range(1, 19))
    # Each resumed from the last one's checkpoint, saved at the other size and resharded.
    assert "'saved_world_size': 2" in phases[1].joinpath("restore_end.txt").read_text()
    assert "'saved_world_size': 1" in phases[2].joinpath("restore_end.txt").read_text()
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=1e-3), (step, losses, expected)
    final, reference = torch.load(phases[2] / "final.pt"), torch.load(tmp_path / "uninterrupted" / "final.pt")
    for name, value in reference.items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5)
