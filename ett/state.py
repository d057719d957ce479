"""Ready-made `Stateful` pieces of a training state, for `run.restore` and `run.checkpoint`.

DCP saves and loads whatever a state dict holds: tensors, plain values, and objects with
`state_dict()` / `load_state_dict()`. These cover what most loops keep beyond that.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


def is_stateful(value: object) -> bool:
    """DCP's `Stateful`, as isinstance would say it (a protocol: that check is slow)."""
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


class ModelOptimizerState(Stateful):
    """Model and optimizer as DCP sees them (sharded DTensor state for FSDP2, plain for DDP or one
    process), saved and loaded in place. A save copies their tensors in the background until
    the next `optimizer.step` (see `Run.checkpoint`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def local_state(self) -> dict:
        """This rank's shards in parameter order, not copied: what the fast tier's snapshot copies
        (ett/snapshots/tier.py). No state-dict machinery: a snapshot is taken every step."""
        params = list(self.model.parameters())
        return {
            "params": [_local(p) for p in params],
            "buffers": [_local(b) for b in self.model.buffers()],
            # .get: optimizer.state is a defaultdict, and an entry made for a parameter the optimizer does
            # not hold (a frozen one) would break its state_dict() (its saves) from then on.
            "optim": [{k: _local(v) for k, v in self.optimizer.state.get(p, {}).items()} for p in params],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }

    @torch.no_grad()
    def load_local_state(self, saved: dict) -> None:
        """Puts back what `local_state` took, on a model and optimizer built and sharded alike."""
        params = list(self.model.parameters())
        for p, t in zip(params, saved["params"], strict=True):
            _as_local(p).copy_(_shard_of(t))
        for b, t in zip(self.model.buffers(), saved["buffers"], strict=True):
            _as_local(b).copy_(_shard_of(t))
        for p, state in zip(params, saved["optim"], strict=True):
            if state:
                self.optimizer.state[p] = {k: _rebuilt(v, p) for k, v in state.items()}
            else:  # none when saved: a frozen parameter, or one not stepped yet
                self.optimizer.state.pop(p, None)
        for group, saved_group in zip(self.optimizer.param_groups, saved["groups"], strict=True):
            group.update(saved_group)

    def changed_only_by_optimizer_step(self) -> list[torch.Tensor]:
        """Parameters and optimizer state: the tensors a save may copy until the next optimizer.step."""
        optimizer_state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*self.model.parameters(), *optimizer_state]


class RNGState(Stateful):
    """Each rank's generators, under a key of its own (DCP would keep one copy of equal keys)."""

    def __init__(self, rank: int):
        self.key = f"rank{rank}"

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state[self.key]["cpu"])
        if "cuda" in state[self.key]:
            torch.cuda.set_rng_state(state[self.key]["cuda"])


class TrainProgress(Stateful):
    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def _as_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class ShardLayout:
    """How a DTensor was laid out, to rebuild it from its local shard (one value: a snapshot's
    header walks every value of the state, every step). `offsets`: where this rank's shard starts
    in the whole tensor, so a snapshot taken at one world size can be resharded at another
    (ett/snapshots/reshard.py); None in snapshots written before it was kept."""

    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offsets: tuple[int, ...] | None = None


# One layout per DTensorSpec (mesh, placements, shape, stride): this rank's shard offsets take DTensor
# 130 us to work out, and a snapshot's header needs them for every tensor, every step; a spec hashes in 0.2 us.
_LAYOUTS: dict = {}


def shard_layout(t: DTensor) -> ShardLayout:
    layout = _LAYOUTS.get(t._spec)
    if layout is None:
        [chunk] = t.__create_chunk_list__()  # DCP's own account of this rank's shard
        layout = _LAYOUTS[t._spec] = ShardLayout(tuple(t.placements), tuple(t.shape), t.stride(), tuple(chunk.offsets))
    return layout


def _local(t: object) -> object:
    """A tensor; a DTensor's shard with its layout, to rebuild it (`_rebuilt`)."""
    if isinstance(t, DTensor):
        # Not to_local(): through autograd it takes 20 us a tensor, on every tensor every step.
        return {"shard": t._local_tensor, "layout": shard_layout(t)}
    return t


def _shard_of(saved: object) -> torch.Tensor:
    return saved["shard"] if isinstance(saved, dict) else saved


def _rebuilt(saved: object, param: torch.Tensor) -> object:
    """An optimizer state value back on the parameter's device (and mesh, for a DTensor)."""
    if isinstance(saved, dict) and "shard" in saved:
        layout = saved["layout"]
        return DTensor.from_local(saved["shard"].to(param.device), param.device_mesh, layout.placements,
                                  run_check=False, shape=torch.Size(layout.shape), stride=layout.stride)
    return saved.to(param.device) if isinstance(saved, torch.Tensor) and saved.dim() else saved
