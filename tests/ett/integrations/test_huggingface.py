"""ETTCallback and resume_checkpoint on a real Trainer (examples/hf_trainer.py, one process):
the events of a job, committed `checkpoint-N` folders, and resume that skips a bad one."""

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

import ett
from ett.checkpoints.folders import verify
from ett.protocol import EVENTS_DIR, MARKER, rank_spool
from ett.integrations.huggingface import resume_checkpoint
from tests.support.cluster import REPO
from tests.support.postgres import free_port
from tests.trainer.trainer_runs import read_events


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory):
    """12 steps of the example as attempt 0 of an ETT job that saves every 5 steps."""
    root = tmp_path_factory.mktemp("hf")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETT_", "RANK", "WORLD_SIZE"))}
    env |= {"ETT_JOB_ID": "hf", "ETT_ATTEMPT": "0", "ETT_EVENT_DIR": str(root / EVENTS_DIR),
            "ETT_CHECKPOINT_DIR": str(root / "ckpt"), "ETT_CHECKPOINT_INTERVAL_STEPS": "5"}
    result = subprocess.run([sys.executable, str(REPO / "examples" / "hf_trainer.py"), "--steps", "12"],
                            env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-4000:]
    return root


def test_the_callback_records_steps_and_saves_and_commits_each_checkpoint(hf_job):
    events = read_events(hf_job / EVENTS_DIR / rank_spool(0))
    kinds = [(e["kind"], e["step"]) for e in events]
    assert kinds[:2] == [("init_start", None), ("init_end", None)] and kinds[-1] == ("train_end", 12)
    assert [s for k, s in kinds if k == "step"] == list(range(1, 13))
    for step in (5, 10):
        start = kinds.index(("ckpt_start", step))
        assert kinds[start - 1] == ("step", step)
        assert kinds[start + 1 : start + 3] == [("ckpt_staged", step), ("ckpt_committed", step)]
    step = next(e for e in events if e["kind"] == "step")["data"]
    assert step["duration"] > 0 and step["tokens"] == 4 * 32
    for step in (5, 10):
        folder = hf_job / "ckpt" / f"checkpoint-{step}"
        manifest = json.loads((folder / MARKER).read_text())
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state.pth"} <= set(manifest["files"])
        assert manifest["step"] == step and verify(folder) is None


def test_resume_checkpoint_takes_the_newest_that_verifies_and_says_why_it_skipped_others(hf_job, tmp_path, caplog,
                                                                                       monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_job / "ckpt", ckpt)
    weights = ckpt / "checkpoint-10" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # corrupt: same size, other bytes
    (ckpt / "checkpoint-15").mkdir()  # torn: killed while the Trainer wrote it
    (ckpt / "checkpoint-15" / "config.json").write_text("{}")
    for name in ("ETT_JOB_ID", "ETT_EVENT_DIR", "ETT_CHECKPOINT_DIR", "ETT_RESUME_FROM"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="ett"):
        with ett.init(checkpoint_dir=ckpt) as run:
            assert resume_checkpoint(run) == str(ckpt / "checkpoint-5")
    assert f"skipping checkpoint {ckpt / 'checkpoint-15'}: no {MARKER} marker" in caplog.text
    assert f"skipping checkpoint {ckpt / 'checkpoint-10'}: model.safetensors fails its CRC-32 check" in caplog.text

    # The service's choice is tried first, and older ones after it.
    monkeypatch.setenv("ETT_RESUME_FROM", str(ckpt / "checkpoint-10"))
    with ett.init(checkpoint_dir=ckpt) as run:
        assert resume_checkpoint(run) == str(ckpt / "checkpoint-5")


def test_the_callback_marks_the_start_up_when_the_script_does_not(tmp_path, monkeypatch):
    import importlib.util

    from transformers import Trainer, TrainingArguments

    from ett.integrations.huggingface import ETTCallback

    spec = importlib.util.spec_from_file_location("hf_example", REPO / "examples" / "hf_trainer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setenv("ETT_JOB_ID", "hf")
    monkeypatch.setenv("ETT_EVENT_DIR", str(tmp_path / EVENTS_DIR))
    with ett.init() as run:
        model = example.LlamaForCausalLM(example.LlamaConfig(
            vocab_size=example.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=example.SEQ_LEN))
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                                 save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=example.SyntheticText(8), callbacks=[ETTCallback(run)]).train()
    kinds = [e["kind"] for e in read_events(tmp_path / EVENTS_DIR / rank_spool(0))]
    assert kinds == ["init_start", "init_end", "step", "step", "step_timing", "train_end"]


def test_the_commit_marker_waits_for_every_ranks_part(tmp_path):
    """Rank 1 writes its part of the checkpoint a second after rank 0: the marker rank 0 writes
    lists both, so a resume never takes a folder that lacks a rank's part for committed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETT_", "RANK", "WORLD_SIZE"))}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "tests.ett.integrations.hf_save_race", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    folder = tmp_path / "checkpoint-5"
    manifest = json.loads((folder / MARKER).read_text())
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(manifest["files"]) and verify(folder) is None


def test_the_callback_says_the_trainers_checkpoints_get_no_snapshots_when_the_job_asks_for_them(tmp_path, monkeypatch,
                                                                                                caplog):
    from ett.integrations.huggingface import ETTCallback

    monkeypatch.setenv("ETT_JOB_ID", "hf")
    monkeypatch.setenv("ETT_EVENT_DIR", str(tmp_path / EVENTS_DIR))
    monkeypatch.setenv("ETT_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("ETT_CHECKPOINT_INTERVAL_STEPS", "10")
    monkeypatch.setenv("ETT_CHECKPOINT_LOCAL_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("ETT_CHECKPOINT_SNAPSHOTS", "1")
    with ett.init() as run, caplog.at_level(logging.WARNING, logger="ett.framework"):
        ETTCallback(run)
    assert ("checkpoint.snapshots: the Hugging Face Trainer saves and loads its own checkpoints, so ETT's per-step "
            "snapshots (and their copies on a peer node) are not taken for it; a failure, a lost node included, "
            "resumes from its newest committed checkpoint (every 10 steps)") in caplog.messages
    monkeypatch.setenv("ETT_CHECKPOINT_SNAPSHOTS", "0")
    with ett.init() as run:
        assert run.saves_its_own_checkpoints("the Hugging Face Trainer") is None
