"""The resume matrix (#46): every kind of state a script passes (tests/ett/checkpoints/matrix_ranks.py: a
Stateful, DCP's nested dict of state_dicts, plain values, FSDP2's DTensors, RNG) x every tier
(persistent, its own node's snapshot, a peer's copy) x the failures that pick them (a rank
SIGKILLed, its node lost with its disk), each ending bitwise equal to an uninterrupted run. Two
real ranks over gloo, each its own node; each restore names the entry the checkpoint holds that
the state no longer has, and the one the state has that the checkpoint lacks."""

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ett.checkpoints.folders import step_folder
from ett.protocol import MARKER
from ett.protocol import JobEnv, rank_spool
from ett.snapshots.folder import SnapshotFolder, snapshots_root
from tests.support import warm
from tests.support.waiting import wait_for
from tests.support.warm import WarmPopen

REPO = Path(__file__).parents[3]
STEPS, HOLD_AT, WORLD = 12, 8, 2


def launch(base: Path, phase: str, tier: str, *hold: int) -> list[WarmPopen]:
    """The ranks of a phase, forked from the suite's warm server (tests/support/warm.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETT_")}
    env |= {"MASTER_ADDR": "127.0.0.1", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1",
            JobEnv.EVENT_DIR: str(base / f"events-{phase}")}
    ranks = []
    for rank in range(WORLD):
        with open(base / f"{phase}-rank-{rank}.log", "w") as log:
            ranks.append(warm.start([sys.executable, "-m", "tests.ett.checkpoints.matrix_ranks", str(base), str(rank),
                                     str(WORLD), phase, tier, str(STEPS), *map(str, hold)], REPO,
                                    env | {"RANK": str(rank), "WORLD_SIZE": str(WORLD)}, log.fileno(), log.fileno()))
    return ranks


def finish(base: Path, phase: str, ranks: list[WarmPopen]) -> None:
    for rank, process in enumerate(ranks):
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            code = "a timeout"
        assert code == 0, f"{phase} rank {rank}: {code}\n" + (base / f"{phase}-rank-{rank}.log").read_text()[-3000:]


def restore_end(base: Path, phase: str, rank: int) -> dict:
    lines = (base / f"events-{phase}" / rank_spool(rank)).read_text().splitlines()
    return next(e for e in map(json.loads, lines) if e["kind"] == "restore_end")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    base = tmp_path_factory.mktemp("uninterrupted")
    finish(base, "whole", launch(base, "whole", "snapshots"))
    return [torch.load(base / f"whole-rank-{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory) -> Callable[[str], Path]:
    """The folder of a first run of a tier killed at HOLD_AT, made once per tier: a case copies it."""
    made: dict[str, Path] = {}

    def failed_run(tier: str) -> Path:
        if tier not in made:
            base = made[tier] = tmp_path_factory.mktemp(f"failed-{tier}")
            first = launch(base, "first", tier, HOLD_AT)
            # Rank 1's snapshot of the held step on its node and on its peer's, and rank 0's own.
            wanted = [(base / "node-1", 1), (base / "node-0", 1), (base / "node-0", 0)] if tier == "snapshots" else []
            wait_for(lambda: (base / "held-first").exists() and all(
                SnapshotFolder(snapshots_root(str(node), WORLD)).path(HOLD_AT, whose).exists()
                for node, whose in wanted) and (step_folder(str(base / "ckpt"), 5) / MARKER).exists(), 120,
                "rank 1 held at its step with what the test needs on disk")  # fmt: skip
            for process in first:  # the failure: the rank, then (as its agent would) the rest of the group
                process.send_signal(signal.SIGKILL)
                process.wait()
        return made[tier]

    return failed_run


# A rank's source None: its node's own copies, at least in part (DCP saves a replicated tensor
# once, from either rank, so a rank may read "mixed").
@pytest.mark.parametrize("tier, node_lost, sources", [
    ("persistent", False, (None, None)),  # DCP's files through the node-local folder
    ("persistent", True, (None, "persistent")),  # rank 1's local copies went with its node
    ("snapshots", False, ("local-snapshot", "local-snapshot")),
    ("snapshots", True, ("local-snapshot", "peer-snapshot")),
])  # fmt: skip
def test_every_kind_of_state_resumes_bitwise_from_every_tier(tmp_path, uninterrupted, failed_runs, tier, node_lost,
                                                             sources):
    shutil.copytree(failed_runs(tier), tmp_path, dirs_exist_ok=True)
    if node_lost:
        shutil.rmtree(tmp_path / "node-1")
    finish(tmp_path, "resumed", launch(tmp_path, "resumed", tier))

    expected_step = HOLD_AT if tier == "snapshots" else 5
    for rank in range(WORLD):
        event = restore_end(tmp_path, "resumed", rank)
        assert event["step"] == expected_step, event
        assert event["data"]["not_restored"] == ["gone.x"] and event["data"]["missing"] == ["new.x"], event
        # DCP keeps one copy of a plain value under a shared key; a snapshot, each rank's own.
        assert event["data"].get("differed") == (["collapsed.saved_by"] if tier == "persistent" else None), event
        if sources[rank] is None:
            assert event["data"]["source"] in ("local", "mixed"), event
        else:
            assert event["data"]["source"] == sources[rank], event
        assert "held by the checkpoint but with no place in the state given, not loaded: gone.x" in (
            tmp_path / f"resumed-rank-{rank}.log").read_text()
        resumed = torch.load(tmp_path / f"resumed-rank-{rank}.pt")
        assert resumed.keys() == uninterrupted[rank].keys()
        for key, value in uninterrupted[rank].items():
            if key in ("plain", "shared"):
                value, got = dict(value), dict(resumed[key])
                assert torch.equal(value.pop("w"), got.pop("w")) and value == got, f"rank {rank}: {key}"
            else:
                assert torch.equal(value, resumed[key]), f"rank {rank}: {key} differs from the uninterrupted run's"
