"""DCP's planners, by the rules every tier shares (ett/checkpoints/state_load.py).

Saving: DCP's own plan, which also records each entry's path with its keys as they are (DCP
spells them all as strings, so a dict keyed by numbers, an optimizer's `state` or a MultiStepLR's
milestones, could not be told from one keyed by digit strings).

Loading (the persistent tier): before DCP's plan is made, each saved entry is given a place where
the state has an empty one (an empty dict or list, a None below the top level) and what is left
over on either side is named; after it, each key of a path is put back as the saved path (or the
state) spells it, and each saved plain value is loaded there (DCP's own would make a list of a
dict keyed by numbers). Checkpoints saved before the typed paths: an all-digit key new to a dict
with no string key is taken for a number.
"""

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from ett.checkpoints.state_load import LoadReport


TYPED_PATHS = "ett.typed_paths"  # in the planner data of a checkpoint whose paths keep their keys' types


class TypedPathsSavePlanner(DefaultSavePlanner):
    """DCP's save plan with each entry's path as the state spells it. Replicated tensors stay
    spread over the ranks as DCP spreads them: by rank 0 alone, a DDP model's whole write would
    be rank 0's, and its steps beside the write slower than its peers'."""

    def set_up_planner(self, state_dict: dict, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        keys = _KeyNames()
        self.mappings = {fqn: keys.typed(state_dict, path) for fqn, path in self.mappings.items()}

    def create_local_plan(self):
        plan = super().create_local_plan()
        return dataclasses.replace(plan, planner_data={**(plan.planner_data or {}), TYPED_PATHS: ()})


class ReportingLoadPlanner(DefaultLoadPlanner):
    """DCP's load plan with the shared rules; what did not match is in `report`. `rank`: this
    rank, whose own entries the checkpoint's file names tell apart from other ranks'."""

    def __init__(self, rank: int) -> None:
        super().__init__(allow_partial_load=True)  # what the checkpoint lacks is reported instead
        self.rank = rank
        self.report = LoadReport()

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            self._match(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        keys = _KeyNames()
        self.mappings = {fqn: keys.typed(self.original_state_dict, path) for fqn, path in self.mappings.items()}

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        _set_at(self.original_state_dict, self.mappings[read_item.dest_index.fqn], torch.load(value, weights_only=False))

    def _match(self, state_dict: dict, metadata: Metadata) -> None:
        flat, _ = flatten_state_dict(state_dict)
        paths, others = metadata.planner_data or {}, _other_ranks_own(metadata, self.rank)
        open_places = {id(c) for value in state_dict.values() for c in _empty_containers(value)}
        typed = TYPED_PATHS in paths
        for key, item in metadata.state_dict_metadata.items():
            if key in flat:
                continue
            path = paths.get(key)
            if path and _place(state_dict, path, item, open_places, typed):
                continue
            top = path[0] if path else key.split(".")[0]
            if key not in others or top not in state_dict:  # an entry the state no longer has: every rank says so
                self.report.not_restored.append(key)
        flat, _ = flatten_state_dict(state_dict)
        self.report.missing = sorted(set(flat) - set(metadata.state_dict_metadata))
        self.report.not_restored.sort()


def _other_ranks_own(metadata: Metadata, rank: int) -> set[str]:
    """The keys whose every byte another rank wrote (DCP's files are `__<rank>_<i>.distcp`). A
    replicated entry, which DCP saves once, may be among them too, so only a key under an entry
    the state still has is passed over for this."""
    writers: dict[str, set[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        writers.setdefault(index.fqn, set()).add(info.relative_path.split("_")[2])
    return {key for key, ranks in writers.items() if str(rank) not in ranks}


def _empty_containers(value: Any) -> list[dict | list]:
    """The empty dicts and lists in `value`, nested in dicts and lists."""
    if isinstance(value, dict | list) and not value:
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
    return [c for item in items for c in _empty_containers(item)]


def _place(state_dict: dict, path: tuple, item: Any, open_places: set[int], typed: bool) -> bool:
    """Makes a place for a saved entry where the state has an empty one (a container of
    `open_places`, or a None below the top level), DCP then loads into it; False where there is
    none. `typed`: the path spells its keys as saved; else (an older checkpoint) an all-digit key
    added to a dict with no string key is a number: an optimizer's `state` is keyed by parameter
    number, and `load_state_dict` passes over string keys."""
    container: Any = state_dict
    for depth, key in enumerate(path):
        last = depth == len(path) - 1
        if isinstance(container, dict) and not typed:
            key = _named(container, key)
        if _holds(container, key):
            if last:
                return False  # DCP matched it, or a non-empty value stands there
            if container[key] is None and depth > 0:  # None below the top: the saved entry takes its place
                container[key] = [] if isinstance(path[depth + 1], int) else {}
                open_places.add(id(container[key]))
            container = container[key]
            continue
        if id(container) not in open_places:
            return False
        if last:  # a tensor DCP copies into; for a plain value, load_bytes puts it there
            placeholder = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(
                item, TensorStorageMetadata) else None
        else:
            placeholder = [] if isinstance(path[depth + 1], int) else {}
        if isinstance(container, list):
            if not isinstance(key, int):
                return False
            container.extend([None] * (key + 1 - len(container)))
        container[key] = placeholder
        if last:
            return True
        open_places.add(id(placeholder))
        container = placeholder
    return False


def _holds(container: Any, key: Any) -> bool:
    if isinstance(container, dict):
        return key in container
    return isinstance(container, list) and isinstance(key, int) and key < len(container)


def _named(container: dict, key: Any) -> Any:
    """The key of `container` DCP spelled `key` (a string); a new one is a number when all digits
    and the dict is empty or keyed by numbers (its first key is one)."""
    if not isinstance(key, str) or key in container:
        return key
    if key.isdigit() and (int(key) in container or not isinstance(next(iter(container), 0), str)):
        return int(key)
    return key


class _KeyNames:
    """DCP's string-spelled paths back to the state's own keys; each dict's names read once."""

    def __init__(self) -> None:
        self._names: dict[int, dict[str, Any]] = {}

    def typed(self, root: Any, path: tuple) -> tuple:
        container, typed = root, []
        for key in path:
            if isinstance(container, dict) and key not in container:
                names = self._names.setdefault(id(container), {str(k): k for k in container})
                key = names.get(key, key)
            typed.append(key)
            try:
                container = container[key]
            except (KeyError, IndexError, TypeError):
                return tuple(path)  # not in the state (DCP loads nothing there): as DCP spelled it
        return tuple(typed)


def _set_at(root: Any, path: tuple, value: Any) -> None:
    container = root
    for key in path[:-1]:
        container = container[key]
    container[path[-1]] = value
