"""ETTCallback, resume_checkpoint and ResumableDataLoader on real Lightning (examples/lightning.py
under torchrun, 2 ranks on gloo): the events of a job, committed and pruned `lightning-<step>`
folders, a clean stop on SIGTERM, resume that skips a torn or corrupt checkpoint, and the loader's
own state."""

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import ett
from ett.checkpoints.folders import verify
from ett.protocol import EVENTS_DIR, MARKER, rank_spool
from ett.integrations.lightning import ResumableDataLoader, resume_checkpoint
from tests.ett.checkpoints.test_sigterm import wait_for_event
from tests.support.cluster import REPO
from tests.support.waiting import wait_for
from tests.trainer.trainer_runs import read_events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stopped_job(tmp_path_factory):
    """The example as attempt 0 of a job saving every 5 steps and keeping 2, stopped by a SIGTERM
    to rank 1 alone once rank 0 has reported step 12: (its folder, torchrun's output)."""
    root = tmp_path_factory.mktemp("pl")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETT_", "RANK", "WORLD_SIZE"))}
    env |= {"ETT_JOB_ID": "pl", "ETT_ATTEMPT": "0", "ETT_EVENT_DIR": str(root / EVENTS_DIR),
            "ETT_CHECKPOINT_DIR": str(root / "ckpt"), "ETT_CHECKPOINT_INTERVAL_STEPS": "5",
            "ETT_CHECKPOINT_KEEP": "2"}  # fmt: skip
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO / "examples" / "lightning.py"), "--steps", "100000", "--step-seconds", "0.05"]  # fmt: skip
    torchrun = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, cwd=REPO)  # fmt: skip
    try:
        rank1 = wait_for_event(root / EVENTS_DIR / rank_spool(1), "init_start")["data"]["pid"]
        wait_for(lambda: any(e["kind"] == "step" and e["step"] >= 12
                             for e in read_events(root / EVENTS_DIR / rank_spool(0))), 120, "rank 0's step 12")
        os.kill(rank1, signal.SIGTERM)  # rank 0 gets none
        output, _ = torchrun.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(torchrun.pid, signal.SIGKILL)
        torchrun.wait()
    return root, output


def test_a_sigterm_saves_that_step_on_every_rank_and_stops_cleanly(stopped_job):
    root, output = stopped_job
    assert output.count("exitcode  : 4") == 2, output[-3000:]  # both ranks: ett.EXIT_STOPPED
    ends = [[e["step"] for e in read_events(root / EVENTS_DIR / rank_spool(r)) if e["kind"] == "train_end"]
            for r in (0, 1)]
    [[stop], [stop_1]] = ends
    assert stop == stop_1 >= 12
    # Saved every 5 steps and at the stop; the newest 2 kept, each committed and whole.
    kept = sorted(p.name for p in (root / "ckpt").iterdir())
    assert kept == [f"lightning-{s:08d}" for s in sorted(set(range(5, stop + 1, 5)) | {stop})[-2:]], kept
    assert all((root / "ckpt" / name / MARKER).exists() and verify(root / "ckpt" / name) is None for name in kept)


def test_the_callback_reports_start_up_steps_and_each_commit(stopped_job):
    root, _ = stopped_job
    events = read_events(root / EVENTS_DIR / rank_spool(0))
    kinds = [e["kind"] for e in events]
    assert kinds[:2] == ["init_start", "init_end"] and kinds[-1] == "train_end"
    steps = [e["step"] for e in events if e["kind"] == "step"]
    assert steps == list(range(1, steps[-1] + 1)) and all(e["data"]["tokens"] == 8 for e in events
                                                           if e["kind"] == "step")
    commits = [e for e in events if e["kind"] == "ckpt_committed"]
    assert [c["step"] for c in commits][:2] == [5, 10] and all(c["data"]["bytes"] > 0 for c in commits)
    for kind in ("ckpt_start", "ckpt_staged"):
        assert [e["step"] for e in events if e["kind"] == kind] == [c["step"] for c in commits]
    assert not [e for e in read_events(root / EVENTS_DIR / rank_spool(1)) if e["kind"] == "ckpt_committed"]


def test_resume_checkpoint_skips_a_torn_and_a_corrupt_newest(stopped_job, tmp_path, caplog, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stopped_job[0] / "ckpt", ckpt)
    older, newest = sorted(p for p in ckpt.iterdir())
    data = newest / "model.ckpt"
    data.write_bytes(data.read_bytes()[:-8] + b"\0" * 8)  # corrupt: same size, other bytes
    torn = ckpt / "lightning-99999999"  # killed while Lightning wrote it
    torn.mkdir()
    (torn / "model.ckpt").write_bytes(b"partial")
    for name in ("ETT_JOB_ID", "ETT_EVENT_DIR", "ETT_CHECKPOINT_DIR", "ETT_RESUME_FROM"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="ett"), ett.init(checkpoint_dir=ckpt) as run:
        assert resume_checkpoint(run) == str(older / "model.ckpt")
    assert f"skipping checkpoint {torn}: no {MARKER} marker" in caplog.text
    assert f"skipping checkpoint {newest}: model.ckpt fails its CRC-32 check" in caplog.text


def test_the_loader_goes_on_after_the_batches_its_state_says_were_served():
    data = torch.utils.data.TensorDataset(torch.arange(24))
    loader = ResumableDataLoader(data, batch_size=4, shuffle=True, seed=3)
    loader.sampler.set_epoch(2)
    whole = [b[0].tolist() for b in loader]
    partial = iter(loader)
    served = [next(partial)[0].tolist() for _ in range(2)]
    state = loader.state_dict()
    assert state == {"epoch": 2, "served": 2} and served == whole[:2]

    resumed = ResumableDataLoader(data, batch_size=4, shuffle=True, seed=3)
    resumed.load_state_dict(state)  # Lightning does this before it sets the epoch and iterates
    assert [b[0].tolist() for b in resumed] == whole[2:]
    resumed.sampler.set_epoch(3)  # the next epoch: whole again
    assert len([b for b in resumed]) == 6 and resumed.state_dict() == {"epoch": 3, "served": 6}
    with pytest.raises(ett.UsageError, match="persistent_workers"):
        ResumableDataLoader(data, num_workers=1, persistent_workers=True)
