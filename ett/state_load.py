"""Loading a saved state into the `state` a script passes: one set of rules for every tier.

The rules are DCP's (`torch.distributed.checkpoint.load`), so a state that resumes right from the
persistent tier resumes right from a snapshot, its own node's or a peer's:
- each top-level entry of `state` is matched with the saved entry of the same key;
- a `Stateful` is asked for its `state_dict()`, that is loaded into, and handed back through its
  `load_state_dict()`;
- dicts and lists are loaded into in place, entry by entry; a tensor (a DTensor: its shard) is
  copied into, in place, so `{"model": model.state_dict()}` loads the model's own parameters;
- a plain value (a number, a string, a list of them) is put back where it was.

Two additions to DCP, both so that nothing is lost without a word:
- below the top level, a dict gains the saved entries it lacks (DCP would pass over them): a fresh
  optimizer's `optimizer.state_dict()["state"]` is empty until its first step, and its moments
  would otherwise be dropped;
- what the checkpoint holds that `state` has no place for (a top-level entry the script no
  longer passes, a tensor where a dict was saved), and what `state` expects that the checkpoint
  lacks, are named in a `LoadReport`: the caller logs it and puts it in the `restore_end` event
  (ett/checkpoint.py). Entries `state` expects and the checkpoint lacks keep their values.
A tensor whose saved shape differs raises, as DCP does: that state cannot be this run's.

Keys are DCP's flattened names (`optim.state.0.exp_avg`), the same for every tier.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

REPORTED_KEYS = 20  # named in an event or a log line; the counts say how many more


@dataclass
class LoadReport:
    not_restored: list[str] = field(default_factory=list)  # saved, but `state` has no place for it
    missing: list[str] = field(default_factory=list)  # in `state`, but not saved: left as it was

    def __bool__(self) -> bool:
        return bool(self.not_restored or self.missing)

    def event_fields(self) -> dict[str, Any]:
        """For `restore_end`: the keys (the first REPORTED_KEYS of each) and how many there are."""
        fields: dict[str, Any] = {}
        for name, keys in (("not_restored", self.not_restored), ("missing", self.missing)):
            if keys:
                fields[name], fields[f"{name}_count"] = keys[:REPORTED_KEYS], len(keys)
        return fields

    def describe(self) -> str:
        """One line for the log."""
        parts = []
        for keys, what in ((self.not_restored, "held by the checkpoint but with no place in the state given, "
                                               "not loaded"),
                           (self.missing, "expected by the state given but not in the checkpoint, left as they were")):
            if keys:
                named = ", ".join(keys[:REPORTED_KEYS]) + (", ..." if len(keys) > REPORTED_KEYS else "")
                parts.append(f"{len(keys)} entries {what}: {named}")
        return "; ".join(parts)


def flat_keys(value: Any, prefix: str) -> list[str]:
    """The DCP names of what `value` holds under `prefix`."""
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):  # a Stateful, as DCP sees it
        value = value.state_dict()
    if isinstance(value, dict) and value:
        flat, _ = flatten_state_dict({prefix: value})
        return sorted(flat)
    return [prefix]


# -- the snapshot tiers: a saved structure, as ett/snapshots.py's `template` took it ----------------


def load_saved(state: dict[str, Any], saved: dict[str, Any]) -> LoadReport:
    """Loads `saved` (a snapshot's state, each tensor a rank's own shard) into `state`, in place."""
    report = LoadReport()
    for key in saved.keys() - state.keys():
        report.not_restored += flat_keys(saved[key], str(key))
    for key, current in state.items():
        if key not in saved:
            report.missing += flat_keys(current, str(key))
        elif hasattr(current, "load_local_state"):  # ett.ModelOptimizerState: its own compact form
            current.load_local_state(saved[key])
        elif hasattr(current, "state_dict") and hasattr(current, "load_state_dict"):
            current_sd = current.state_dict()
            current.load_state_dict(_loaded(current_sd, saved[key], str(key), report))
        else:
            state[key] = _loaded(current, saved[key], str(key), report)
    report.not_restored.sort()
    report.missing.sort()
    return report


def _loaded(current: Any, saved: Any, name: str, report: LoadReport) -> Any:
    """What stands at `name` once `saved` is loaded into `current`: `current` itself, loaded in
    place, where it can hold it; else `saved`."""
    if isinstance(current, dict) and isinstance(saved, dict):
        for key, item in saved.items():
            # A saved entry the dict lacks is added: see the module's docstring.
            current[key] = _loaded(current[key], item, f"{name}.{key}", report) if key in current else item
        for key in current.keys() - saved.keys():
            report.missing += flat_keys(current[key], f"{name}.{key}")
        return current
    if isinstance(current, list | tuple) and isinstance(saved, list | tuple) and len(current) == len(saved):
        items = [_loaded(c, s, f"{name}.{i}", report) for i, (c, s) in enumerate(zip(current, saved, strict=True))]
        if isinstance(current, list):
            current[:] = items
            return current
        return type(current)(items)
    if isinstance(current, torch.Tensor) and isinstance(saved, torch.Tensor):
        local = current._local_tensor if isinstance(current, DTensor) else current  # the shard a snapshot holds
        if local.shape != saved.shape:
            raise ValueError(f"{name}: the checkpoint's tensor has shape {tuple(saved.shape)}, the state's "
                             f"{tuple(local.shape)}: it was saved by a different model or layout")
        with torch.no_grad():
            local.copy_(saved)
        return current
    if isinstance(current, torch.Tensor | dict) and not isinstance(saved, type(current)):
        report.not_restored += flat_keys(saved, name)  # a tensor where a dict was saved, or the reverse
        return current
    return saved  # a plain value, put back where it was


# -- the persistent tier: DCP's own load, with the same additions ------------------------------


class ReportingLoadPlanner(DefaultLoadPlanner):
    """DCP's load plan, which also adds below the top level what the checkpoint holds and the
    state lacks, and reports what it could not place and what the checkpoint lacks (`report`)."""

    def __init__(self) -> None:
        super().__init__(allow_partial_load=True)  # what the checkpoint lacks is reported instead
        self.report = LoadReport()

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            flat, _ = flatten_state_dict(state_dict)
            paths = metadata.planner_data or {}
            for key, item in metadata.state_dict_metadata.items():
                if key not in flat and not _place(state_dict, paths.get(key), item):
                    self.report.not_restored.append(key)
            flat, _ = flatten_state_dict(state_dict)
            self.report.missing = sorted(set(flat) - set(metadata.state_dict_metadata))
            self.report.not_restored.sort()
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _place(state_dict: dict, path: tuple | None, item: Any) -> bool:
    """Adds an empty place for a saved entry below the top level, in dicts the state already
    has (DCP then loads into it); False where there is none to be had."""
    if not path or len(path) < 2 or path[0] not in state_dict:
        return False
    container, typed = state_dict, []
    for key in path[:-1]:
        if isinstance(container, dict):
            key = _typed_key(container, key)
            container = container.setdefault(key, {})
        elif isinstance(container, list) and isinstance(key, int) and key < len(container):
            container = container[key]
        else:
            return False
        typed.append(key)
    if not isinstance(container, dict):
        return False
    placeholder = (torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata)
                   else None)  # bytes: DCP's load puts the saved value there
    typed.append(_typed_key(container, path[-1]))
    set_element(state_dict, tuple(typed), placeholder)
    return True


def _typed_key(container: dict, key: Any) -> Any:
    """DCP's saved paths spell every dict key as a string; an optimizer's `state` is keyed by
    parameter number, and `optimizer.load_state_dict` passes over string keys without a word. So
    an all-digit key added to a dict with no string key (empty, as a fresh optimizer's `state`
    is, or keyed by numbers) is a number."""
    if isinstance(key, str) and key.isdigit() and key not in container and all(isinstance(k, int) for k in container):
        return int(key)
    return key
