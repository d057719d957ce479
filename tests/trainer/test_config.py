"""Presets, dotted overrides typed from the dataclass fields, validation naming the field, and
the exit code of a configuration error."""

import logging
import signal
import subprocess
import sys

import pytest

from ett.protocol import EXIT_CONFIG_ERROR
from tests.trainer.trainer_runs import REPO
from trainer.config import PRESETS, parse_args
from trainer.errors import ConfigError
from trainer.train import main


@pytest.mark.parametrize("name, world_size", [("tiny", 1), ("cpu-demo", 4), ("gpu-moe", 8)])
def test_every_preset_is_valid(name, world_size):
    cfg = parse_args(["--preset", name])
    cfg.validate(world_size)  # raises ConfigError naming the field of a preset that does not hold
    assert cfg == PRESETS[name]() and world_size % cfg.parallel.ep == 0


def test_overrides_are_typed_from_the_fields_and_applied_after_the_preset():
    cfg = parse_args([
        "--moe.num_experts", "16", "--parallel.zero=2", "--train.lr", "1e-3", "--moe.shared_expert", "true",
        "--moe.capacity_factor", "none", "--checkpoint.dir", "/ckpt", "--checkpoint.resume_from", "auto",
        "--preset", "cpu-demo",
    ])
    assert cfg.moe.num_experts == 16 and cfg.parallel.zero == 2 and cfg.train.lr == 1e-3
    assert cfg.moe.shared_expert is True and cfg.moe.capacity_factor is None
    assert cfg.checkpoint.dir == "/ckpt" and cfg.checkpoint.resume_from == "auto"
    assert cfg.parallel.ep == 2  # from the preset
    assert parse_args(["--moe.capacity_factor", "1.5"]).moe.capacity_factor == 1.5


@pytest.mark.parametrize("argv, field", [
    (["--moe.num_experts", "many"], "--moe.num_experts"),
    (["--moe.shared_expert", "maybe"], "--moe.shared_expert"),
    (["--moe.nope", "1"], "--moe.nope"),
    (["--nope.steps", "1"], "--nope.steps"),
    (["--train.steps"], "--train.steps"),
    (["--preset", "huge"], "--preset"),
    (["steps=3"], "steps=3"),
])
def test_a_bad_override_names_it(argv, field):
    with pytest.raises(ConfigError, match=field):
        parse_args(argv)


@pytest.mark.parametrize("argv, world_size, field", [
    (["--moe.top_k", "5"], 1, "moe.top_k"),
    (["--model.dim", "33"], 1, "model.dim"),
    (["--train.seq_len", "64"], 1, "train.seq_len"),
    (["--parallel.zero", "4"], 1, "parallel.zero"),
    (["--parallel.ep", "2"], 3, "parallel.ep"),
    (["--parallel.ep", "3", "--moe.num_experts", "4"], 3, "moe.num_experts"),
    (["--checkpoint.keep", "0"], 1, "checkpoint.keep"),
    (["--log.interval_steps", "0"], 1, "log.interval_steps"),
    (["--model.dropout", "1.0"], 1, "model.dropout"),
])
def test_an_impossible_value_names_the_field(argv, world_size, field):
    with pytest.raises(ConfigError, match=field):
        parse_args(argv).validate(world_size)


def test_experts_that_do_not_split_evenly_over_the_ranks_are_refused_saying_so():
    with pytest.raises(ConfigError) as refused:
        parse_args(["--moe.num_experts", "6", "--parallel.ep", "4"]).validate(4)
    assert str(refused.value) == "moe.num_experts (6) must be divisible by parallel.ep (4)"


def test_the_learning_rate_warms_up_then_decays_to_its_minimum():
    train = parse_args(["--train.steps", "100", "--train.warmup_steps", "10"]).train
    assert train.lr_at(5) == pytest.approx(train.lr / 2) and train.lr_at(10) == pytest.approx(train.lr)
    assert train.lr_at(55) == pytest.approx((train.lr + train.min_lr) / 2) and train.lr_at(100) == pytest.approx(train.min_lr)


@pytest.fixture
def in_process_main():
    """main() configures the trainer's logging and its SIGTERM handler: put them back after."""
    loggers = [logging.getLogger(name) for name in ("trainer", "ett")]
    saved = [(logger.handlers[:], logger.propagate, logger.level) for logger in loggers]
    sigterm = signal.getsignal(signal.SIGTERM)
    yield main
    for logger, (handlers, propagate, level) in zip(loggers, saved):
        logger.handlers[:], logger.propagate, logger.level = handlers, propagate, level
    signal.signal(signal.SIGTERM, sigterm)


def test_main_returns_3_for_a_value_that_fails_validation(monkeypatch, capsys, in_process_main):
    monkeypatch.delenv("ETT_EVENT_DIR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert in_process_main(["--preset", "cpu-demo", "--moe.num_experts", "3"]) == EXIT_CONFIG_ERROR
    assert "moe.num_experts" in capsys.readouterr().err


def test_the_trainer_exits_with_code_3_naming_a_bad_override():
    result = subprocess.run([sys.executable, "-m", "trainer.train", "--preset", "tiny", "--train.steps", "ten"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_CONFIG_ERROR
    assert "--train.steps: expected int, got 'ten'" in result.stderr


def test_the_help_lists_the_presets_and_fields(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert all(name in help_text for name in PRESETS) and "--checkpoint.interval_steps" in help_text


def test_at_fewer_ranks_expert_parallelism_is_kept_where_it_divides_and_else_the_largest_that_does():
    cfg = parse_args(["--preset", "cpu-demo", "--parallel.ep", "4"])  # 8 experts, full size 8
    assert cfg.fit_to(world_size=4, full_world_size=8) is None and cfg.parallel.ep == 4
    assert cfg.fit_to(world_size=2, full_world_size=8) == ("parallel.ep 4 does not divide 2 ranks: "
                                                           "expert parallelism 2, experts resharded")
    assert cfg.parallel.ep == 2


@pytest.mark.parametrize("override, named", [(["--model.dropout", "0.1"], "model.dropout 0.1"),
                                             (["--moe.aux_free_bias", "true"], "moe.aux_free_bias")])
def test_a_configuration_that_a_split_would_change_is_not_elastic_and_refused_at_fewer_ranks(override, named):
    cfg = parse_args(["--preset", "tiny", *override])
    assert named in cfg.not_elastic_because()
    assert cfg.fit_to(world_size=2, full_world_size=2) is None  # at full size it runs as before
    with pytest.raises(ConfigError, match=f"this run has 1 of its 2 ranks and cannot keep its training the same "
                                          f"at fewer: {named}"):
        cfg.fit_to(world_size=1, full_world_size=2)
