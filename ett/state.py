"""Ready-made `Stateful` pieces of a training state, for `run.restore` and `run.checkpoint`.

DCP saves and loads whatever a state dict holds: tensors, plain values, and objects with
`state_dict()` / `load_state_dict()`. These cover what most loops keep beyond that.
"""

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


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
