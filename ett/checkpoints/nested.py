"""A `Stateful` below the top level of `state` (`{"data": {"sampler": sampler}}`), saved and restored as one
at the top is, on every tier.

DCP asks only the top-level entries of a state for their `state_dict()`: one further down is pickled whole, and
a load puts the unpickled copy in its place, so the script's own object keeps its old state without a word (a
sampler, a data position resumed from the start). So each top-level entry that holds a Stateful below it is
handed to the tiers as one Stateful of its own (`lifted`): its `state_dict()` is the entry with each Stateful
in it replaced by that one's `state_dict()`, and its `load_state_dict()` hands each its part back through the
Stateful's own `load_state_dict()`. Containers with no Stateful below are handed over as they are, so a tier
still loads their tensors and values in place (ett/checkpoints/state_load.py's rules).
"""

from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ett.checkpoints.state_load import rebuilt
from ett.state import is_stateful

# What is never a Stateful nor holds one.
LEAVES = (torch.Tensor, str, bytes, int, float, bool, type(None))


class NestedStatefuls(Stateful):
    """A top-level entry of `state` with Statefuls below its top."""

    def __init__(self, value: Any) -> None:
        self.value = value
        # Each Stateful's own state_dict() as the last state_dict() call was given it (by id), where it holds
        # Statefuls (else None): a load puts them back in their places without asking it twice (a tier asks
        # for the state_dict, loads into it, hands it back).
        self._given: dict[int, Any] = {}

    def state_dict(self) -> Any:
        self._given = {}
        return _state_dicts(self.value, self._given)

    def load_state_dict(self, loaded: Any) -> None:
        _load_into(self.value, loaded, self._given)


def lifted(state: dict[str, Any]) -> dict[str, Any]:
    """`state`, each top-level entry that holds a Stateful below its top, or is one, made one (NestedStatefuls):
    a Stateful's `state_dict()` may hold Statefuls too (`{"step": n, "loader": loader}`). Not ett's own
    (ModelOptimizerState, with its `local_state`): the tiers know it, and it holds only tensors."""
    return {key: NestedStatefuls(value) if _lifts(value) else value for key, value in state.items()}


def _lifts(value: Any) -> bool:
    if is_stateful(value):
        return not hasattr(value, "local_state")
    return _reshaped(value)


def put_back(state: dict[str, Any], handed: dict[str, Any]) -> None:
    """Into `state`, what a tier put in place of its top-level entries in `handed` (`lifted(state)`, loaded):
    a value the checkpoint holds, where the entry could not be loaded in place."""
    for key, value in handed.items():
        if not isinstance(value, NestedStatefuls):
            state[key] = value


def _reshaped(value: Any) -> bool:
    """Whether `value` is or holds what the tiers are handed in another form: a Stateful (its state_dict()),
    or a tuple holding a tensor (as a list: DCP pickles a tuple whole, so a load would put new tensors in
    place of its own where the snapshot tiers load them in place)."""
    if isinstance(value, LEAVES):  # most of a state: asked first, as a failed hasattr on a tensor is slow
        return False
    if is_stateful(value):
        return True
    if isinstance(value, dict):
        return any(_reshaped(item) for item in value.values())
    if isinstance(value, tuple):
        return any(isinstance(item, torch.Tensor) or _reshaped(item) for item in value)
    if isinstance(value, list):
        return any(_reshaped(item) for item in value)
    return False


def _state_dicts(value: Any, given: dict[int, Any]) -> Any:
    """`value` with each Stateful in it replaced by its state_dict() (noted in `given`) and each tuple on the
    way by a list; a container with neither below is `value` itself."""
    if is_stateful(value):
        mine = value.state_dict()
        reshaped = _reshaped(mine)  # the Statefuls in its own state_dict too
        given[id(value)] = mine if reshaped else None
        return _state_dicts(mine, given) if reshaped else mine
    if not _reshaped(value):
        return value
    if isinstance(value, dict):
        return {key: _state_dicts(item, given) for key, item in value.items()}
    return [_state_dicts(item, given) for item in value]


def _load_into(current: Any, loaded: Any, given: dict[int, Any]) -> Any:
    """What stands where `current` stood once `loaded` (as `_state_dicts(current)` was loaded by a tier) is
    back: each Stateful given its part, the rest of a container on a Stateful's path taken from `loaded`."""
    if is_stateful(current):
        # A Stateful in its own state_dict() is loaded through its own load_state_dict() and handed back itself.
        mine = given[id(current)] if id(current) in given else current.state_dict()
        current.load_state_dict(_load_into(mine, loaded, given) if _reshaped(mine) else loaded)
        return current
    if not _reshaped(current):
        return loaded  # loaded in place where it could be, else the value the checkpoint holds
    if isinstance(current, dict) and isinstance(loaded, dict):
        for key, item in loaded.items():
            current[key] = _load_into(current[key], item, given) if key in current else item
        return current
    if isinstance(current, list | tuple) and isinstance(loaded, list | tuple):
        # Of another length, the entries both have are loaded; a tier named the others (LoadReport).
        return rebuilt(current, [_load_into(c, item, given) for c, item in zip(current, loaded)]
                       + list(current[len(loaded):]))
    return current  # a tier names what did not fit (LoadReport); the Statefuls in it keep their state
