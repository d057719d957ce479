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
- an empty dict below the top level of `state` (not in a Stateful's: its `state_dict()` says
  what it loads) gains the saved entries (DCP would pass over them): a fresh optimizer's
  `optimizer.state_dict()["state"]` is empty until its first step, and its moments would
  otherwise be dropped. Only an empty one: a dict with entries says what it wants, and a
  persistent checkpoint holds other ranks' entries beside this rank's;
- what the checkpoint holds that `state` has no place for (a top-level entry the script no
  longer passes, a key a Stateful no longer asks for, a tensor where a dict was saved), and what
  `state` expects that the checkpoint lacks, are named in a `LoadReport`: the caller logs it and
  puts it in the `restore_end` event (ett/checkpoint.py). Entries `state` expects and the
  checkpoint lacks keep their values. A persistent checkpoint also holds the entries of other
  ranks kept under keys of their own (ett.RNGState's `rank3`): those are not this rank's, and
  are neither loaded nor named.
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

from ett.rank_values import describe
from ett.state import is_stateful

REPORTED_KEYS = 20  # named in an event or a log line; the counts say how many more


@dataclass
class LoadReport:
    not_restored: list[str] = field(default_factory=list)  # saved, but `state` has no place for it
    missing: list[str] = field(default_factory=list)  # in `state`, but not saved: left as it was
    # Differed between ranks when saved; the persistent tier holds one rank's (ett/rank_values.py).
    differed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.not_restored or self.missing or self.differed)

    def event_fields(self) -> dict[str, Any]:
        """For `restore_end`: the keys (the first REPORTED_KEYS of each) and how many there are."""
        fields: dict[str, Any] = {}
        for name, keys in (("not_restored", self.not_restored), ("missing", self.missing),
                           ("differed", self.differed)):
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
        if self.differed:
            parts.append(describe(self.differed))
        return "; ".join(parts)


def flat_keys(value: Any, prefix: str) -> list[str]:
    """The DCP names of what `value` holds under `prefix`."""
    if is_stateful(value):
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
        elif is_stateful(current):
            current.load_state_dict(_loaded(current.state_dict(), saved[key], str(key), report, fill=False))
        else:
            state[key] = _loaded(current, saved[key], str(key), report, fill=True)
    report.not_restored.sort()
    report.missing.sort()
    return report


def _loaded(current: Any, saved: Any, name: str, report: LoadReport, fill: bool) -> Any:
    """What stands at `name` once `saved` is loaded into `current`: `current` itself, loaded in
    place, where it can hold it; else `saved`. `fill`: an empty dict gains the saved entries."""
    if isinstance(current, dict) and isinstance(saved, dict):
        empty = not current
        for key, item in saved.items():
            if key in current:
                current[key] = _loaded(current[key], item, f"{name}.{key}", report, fill)
            elif fill and empty:
                current[key] = item
            else:
                report.not_restored += flat_keys(item, f"{name}.{key}")
        for key in current.keys() - saved.keys():
            report.missing += flat_keys(current[key], f"{name}.{key}")
        return current
    if isinstance(current, list | tuple) and isinstance(saved, list | tuple) and len(current) == len(saved):
        items = [_loaded(c, s, f"{name}.{i}", report, fill) for i, (c, s) in enumerate(zip(current, saved, strict=True))]
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
    """DCP's load plan, which also adds to the plain dicts of the state what the checkpoint holds
    and they lack, and reports what it could not place and what the checkpoint lacks (`report`).
    `stateful`: the top-level keys whose entry is a Stateful (DCP hands the planner its state_dict);
    `rank`: this rank, whose own entries the checkpoint's file names tell apart from others'."""

    def __init__(self, stateful: set[str], rank: int) -> None:
        super().__init__(allow_partial_load=True)  # what the checkpoint lacks is reported instead
        self.stateful, self.rank = stateful, rank
        self.report = LoadReport()

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            flat, _ = flatten_state_dict(state_dict)
            paths, others = metadata.planner_data or {}, _other_ranks_own(metadata, self.rank)
            fillable = {id(d) for key, value in state_dict.items() if key not in self.stateful
                        for d in _empty_dicts(value)}  # fmt: skip
            for key, item in metadata.state_dict_metadata.items():
                if key in flat:
                    continue
                path = paths.get(key)
                if path and _place(state_dict, path, item, fillable):
                    continue
                top = path[0] if path else key.split(".")[0]
                if key not in others or top not in state_dict:  # an entry the state no longer has: every rank says so
                    self.report.not_restored.append(key)
            flat, _ = flatten_state_dict(state_dict)
            self.report.missing = sorted(set(flat) - set(metadata.state_dict_metadata))
            self.report.not_restored.sort()
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _other_ranks_own(metadata: Metadata, rank: int) -> set[str]:
    """The keys whose every byte another rank wrote (DCP's files are `__<rank>_<i>.distcp`). A
    replicated entry, which DCP saves once, may be among them too, so only a key under an entry
    the state still has is passed over for this."""
    writers: dict[str, set[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        writers.setdefault(index.fqn, set()).add(info.relative_path.split("_")[2])
    return {key for key, ranks in writers.items() if str(rank) not in ranks}


def _empty_dicts(value: Any) -> list[dict]:
    """The empty dicts in `value`, nested in dicts and lists."""
    if isinstance(value, dict):
        return [value] if not value else [d for item in value.values() for d in _empty_dicts(item)]
    if isinstance(value, list | tuple):
        return [d for item in value for d in _empty_dicts(item)]
    return []


def _place(state_dict: dict, path: tuple, item: Any, fillable: set[int]) -> bool:
    """Adds an empty place for a saved entry in a dict of `fillable` (the state's empty dicts,
    and those made here; DCP then loads into it); False where there is none to be had."""
    container, typed = state_dict, []
    for key in path[:-1]:
        if isinstance(container, dict) and (key in container or _typed_key(container, key) in container):
            key = key if key in container else _typed_key(container, key)
            container = container[key]
        elif isinstance(container, dict) and id(container) in fillable:
            key = _typed_key(container, key)
            container[key] = {}
            container = container[key]
            fillable.add(id(container))
        elif isinstance(container, list) and isinstance(key, int) and key < len(container):
            container = container[key]
        else:
            return False
        typed.append(key)
    if not isinstance(container, dict) or id(container) not in fillable:
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
