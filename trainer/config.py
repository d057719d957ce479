"""Job configuration: one dataclass per part (each beside the code it configures), gathered in
JobConfig; named presets; dotted command-line overrides typed from the dataclass fields.

    python -m trainer.train --preset cpu-demo --moe.num_experts 16 --checkpoint.dir /ckpt
"""

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field

from ett.checkpoint import CheckpointConfig
from trainer.data import DataConfig
from trainer.errors import ConfigError
from trainer.log import LogConfig
from trainer.model import ModelConfig
from trainer.moe import MoEConfig
from trainer.parallel import ParallelConfig


@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 8  # sequences per rank and step
    seq_len: int = 128
    lr: float = 3e-4  # peak, after linear warmup; cosine decay to min_lr at the last step
    min_lr: float = 3e-5
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0  # weight init (identical on every rank)

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")

    def lr_at(self, step: int) -> float:
        """Learning rate of a 1-based step: a function of the step alone, so resume needs no scheduler state."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def not_elastic_because(self) -> str | None:
        """Why a step would not be the same split over fewer ranks, or None (docs/trainer.md, "Elastic")."""
        if self.model.dropout > 0:
            return f"model.dropout {self.model.dropout} draws each rank's own masks"
        if self.model.ffn_type == "moe" and self.moe.aux_free_bias:
            return "moe.aux_free_bias moves the router's bias after every forward, not once a step"
        return None

    def fit_to(self, world_size: int, full_world_size: int) -> str | None:
        """A run on fewer ranks than its full size (validated at that size): refused where it cannot
        keep its training the same; parallel.ep kept where it divides the present size, else the
        largest below it that divides both it and moe.num_experts (the experts resharded on load).
        Says so when ep changed."""
        if world_size == full_world_size:
            return None
        if (why := self.not_elastic_because()) is not None:
            raise ConfigError(f"this run has {world_size} of its {full_world_size} ranks and cannot keep its "
                              f"training the same at fewer: {why}")
        ep = self.parallel.ep
        experts = self.moe.num_experts if self.model.ffn_type == "moe" else 1
        fitted = max(d for d in range(1, ep + 1) if world_size % d == 0 and experts % d == 0)
        if fitted == ep:
            return None
        self.parallel.ep = fitted
        return f"parallel.ep {ep} does not divide {world_size} ranks: expert parallelism {fitted}, experts resharded"

    def validate(self, world_size: int) -> None:
        try:
            for section in dataclasses.fields(self):
                getattr(self, section.name).validate()
        except ValueError as error:
            raise ConfigError(str(error)) from error
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(f"train.seq_len ({self.train.seq_len}) must be <= model.max_seq_len ({self.model.max_seq_len})")
        if world_size % self.parallel.ep:
            raise ConfigError(f"parallel.ep ({self.parallel.ep}) must divide the number of ranks ({world_size})")
        if self.model.ffn_type == "moe" and self.moe.num_experts % self.parallel.ep:
            raise ConfigError(f"moe.num_experts ({self.moe.num_experts}) must be divisible by parallel.ep ({self.parallel.ep})")


def tiny() -> JobConfig:
    """Tests and CI: a few seconds per run on a CPU."""
    return JobConfig(
        model=ModelConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=32),
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32),
        train=TrainConfig(steps=20, batch_size=4, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=2),
        log=LogConfig(interval_steps=5),
    )


def cpu_demo() -> JobConfig:
    """The demo: 2 nodes x 2 ranks on CPUs, expert parallelism 2, ZeRO-3."""
    return JobConfig(
        model=ModelConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=64),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden_dim=64, capacity_factor=1.25),
        parallel=ParallelConfig(ep=2, zero=3),
        train=TrainConfig(steps=300, batch_size=4, seq_len=64, lr=2e-3, min_lr=2e-4, warmup_steps=10),
        checkpoint=CheckpointConfig(interval_steps=25),
        log=LogConfig(interval_steps=10),
    )


def gpu_moe() -> JobConfig:
    """One GPU node: 1.26B-parameter MoE (32 experts, top-2, 0.13B active), bf16, ZeRO-3.
    Set --parallel.ep to the GPU count (it must divide 32) for expert parallelism."""
    return JobConfig(
        model=ModelConfig(dim=1024, n_layers=12, n_heads=16, max_seq_len=2048),
        moe=MoEConfig(num_experts=32, top_k=2, expert_hidden_dim=1024, aux_free_bias=True, load_balance_coef=0.001),
        parallel=ParallelConfig(ep=1, zero=3, mixed_precision="bf16"),
        train=TrainConfig(steps=2000, batch_size=8, seq_len=2048, lr=3e-4, min_lr=3e-5, warmup_steps=100),
        checkpoint=CheckpointConfig(interval_steps=200),
        log=LogConfig(interval_steps=10),
    )


PRESETS = {"tiny": tiny, "cpu-demo": cpu_demo, "gpu-moe": gpu_moe}

USAGE = """usage: python -m trainer.train [--preset NAME] [--SECTION.FIELD VALUE ...]

presets: {presets}
fields (defaults of the preset shown):
{fields}
exit codes: 0 done, 3 configuration error, 4 stopped by SIGTERM after a final checkpoint
"""


def _coerce(raw: str, annotation, name: str):
    """Parse a command-line string as the field's type (int, float, bool, str, X | None)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if raw.lower() in ("none", "null"):
            return None
        return _coerce(raw, args[0], name)
    if annotation is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{name}: expected true or false, got {raw!r}")
    if annotation in (int, float):
        try:
            return annotation(raw)
        except ValueError:
            raise ConfigError(f"--{name}: expected {annotation.__name__}, got {raw!r}") from None
    return raw


def apply_override(cfg: JobConfig, dotted: str, raw: str) -> None:
    section_name, _, field_name = dotted.partition(".")
    sections = {f.name for f in dataclasses.fields(cfg)}
    if section_name not in sections:
        raise ConfigError(f"--{dotted}: unknown section {section_name!r} (one of {', '.join(sorted(sections))})")
    section = getattr(cfg, section_name)
    hints = typing.get_type_hints(type(section))
    if field_name not in hints:
        raise ConfigError(f"--{dotted}: unknown field {field_name!r} of {section_name} (one of {', '.join(hints)})")
    setattr(section, field_name, _coerce(raw, hints[field_name], dotted))


def parse_args(argv: list[str]) -> JobConfig:
    """`--preset NAME` first picks the defaults, then every `--section.field value` (or
    `--section.field=value`) overrides one field, in order."""
    pairs = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(usage(tiny()))
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options are --preset NAME and --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if not args:
                raise ConfigError(f"--{key}: missing value")
            value = args.pop(0)
        pairs.append((key, value))
    presets = [value for key, value in pairs if key == "preset"]
    preset = presets[-1] if presets else "tiny"
    if preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    cfg = PRESETS[preset]()
    for key, value in pairs:
        if key != "preset":
            apply_override(cfg, key, value)
    return cfg


def usage(cfg: JobConfig) -> str:
    lines = [f"  --{section}.{name} {value!r}" for section, values in dataclasses.asdict(cfg).items() for name, value in values.items()]
    return USAGE.format(presets=", ".join(PRESETS), fields="\n".join(lines))
