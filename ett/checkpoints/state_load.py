"""Loading a saved state into the `state` a script passes: one set of rules for every tier.

The rules are DCP's (`torch.distributed.checkpoint.load`), so a state that resumes right from the
persistent tier resumes right from a snapshot, its own node's or a peer's:
- each top-level entry of `state` is matched with the saved entry of the same key;
- a `Stateful` is asked for its `state_dict()`, that is loaded into, and handed back through its
  `load_state_dict()`;
- dicts and lists are loaded into in place, entry by entry; a tensor (a DTensor: its shard) is
  copied into, in place, so `{"model": model.state_dict()}` loads the model's own parameters;
- a plain value (a number, a string, a list of them) is put back where it was;
- a list DCP saves entry by entry (it holds a tensor or a dict) of another length than saved: the
  entries both have are loaded, the others named.

Additions to DCP, so that nothing is lost without a word and every tier does the same:
- an empty dict or list below the top level of `state`, and a None there, take what the
  checkpoint holds at that place (DCP would pass over it): a fresh optimizer's
  `optimizer.state_dict()["state"]` is empty until its first step, and its moments would
  otherwise be dropped; a data loader's sampler is None until it starts. Only an empty one: a
  dict with entries says what it wants, and a persistent checkpoint holds other ranks' entries
  beside this rank's;
- keys come back as they were saved: DCP spells every key of a path as a string, so a dict
  keyed by numbers (a MultiStepLR's milestones) came back with string keys beside its own;
- what the checkpoint holds that `state` has no place for (a top-level entry the script no
  longer passes, a tensor where a dict was saved), and what `state` expects that the checkpoint
  lacks, are named in a `LoadReport`: the caller logs it and puts it in the `restore_end` event
  (ett/checkpoint.py). Entries `state` expects and the checkpoint lacks keep their values. A
  persistent checkpoint also holds the entries of other ranks kept under keys of their own
  (ett.RNGState's `rank3`): those are not this rank's, and are neither loaded nor named.
A tensor whose saved shape differs raises, as DCP does: that state cannot be this run's.

The persistent tier's side is ett/checkpoints/planners.py.
Keys are DCP's flattened names (`optim.state.0.exp_avg`), the same for every tier.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from ett.checkpoints.rank_values import REPORTED_KEYS, describe, named
from ett.state import is_stateful



@dataclass
class LoadReport:
    not_restored: list[str] = field(default_factory=list)  # saved, but `state` has no place for it
    missing: list[str] = field(default_factory=list)  # in `state`, but not saved: left as it was
    # Differed between ranks when saved; the persistent tier holds one rank's (ett/checkpoints/rank_values.py).
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
                parts.append(f"{len(keys)} entries {what}: {named(keys)}")
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


# -- the snapshot tiers: a saved structure, as ett/snapshots/tier.py's `template` took it ----------------


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
            current.load_state_dict(_loaded(current.state_dict(), saved[key], str(key), report))
        else:
            state[key] = _loaded(current, saved[key], str(key), report)
    report.not_restored.sort()
    report.missing.sort()
    return report


def _loaded(current: Any, saved: Any, name: str, report: LoadReport) -> Any:
    """What stands at `name` once `saved` is loaded into `current`: `current` itself, loaded in
    place, where it can hold it; else `saved` (an empty dict gains the saved entries)."""
    if isinstance(current, dict) and isinstance(saved, dict):
        empty = not current
        for key, item in saved.items():
            if key in current:
                current[key] = _loaded(current[key], item, f"{name}.{key}", report)
            elif empty:
                current[key] = item
            else:
                report.not_restored += flat_keys(item, f"{name}.{key}")
        for key in current.keys() - saved.keys():
            report.missing += flat_keys(current[key], f"{name}.{key}")
        return current
    if isinstance(current, list | tuple) and isinstance(saved, list | tuple) and len(current) == len(saved):
        return rebuilt(current, [_loaded(c, s, f"{name}.{i}", report)
                                 for i, (c, s) in enumerate(zip(current, saved, strict=True))])
    if isinstance(current, list) and current and isinstance(saved, list) and (_walked(current) or _walked(saved)):
        # Of another length (an empty one takes what was saved, below), and saved entry by entry as DCP does
        # such a list: the entries both have are loaded and the others named, as on the persistent tier.
        # Saved as one value to DCP (a list of plain values): named whole, as there.
        walked = _walked(saved)
        common = min(len(current), len(saved)) if walked else 0
        current[:common] = [_loaded(current[i], saved[i], f"{name}.{i}", report) for i in range(common)]
        report.not_restored += ([key for i in range(common, len(saved)) for key in flat_keys(saved[i], f"{name}.{i}")]
                                if walked else [name])
        for i in range(common, len(current)):
            report.missing += flat_keys(current[i], f"{name}.{i}")
        return current
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
        if isinstance(current, dict):
            report.missing += flat_keys(current, name)  # and what the dict expects is not there
        return current
    return saved  # a plain value, put back where it was


def rebuilt(current: list | tuple, items: list) -> list | tuple:
    """`current` holding `items` instead: a list in place, a tuple (a namedtuple too) anew."""
    if isinstance(current, list):
        current[:] = items
        return current
    return type(current)(*items) if hasattr(current, "_fields") else type(current)(items)


def _walked(value: Any) -> bool:
    """Whether DCP saves `value` entry by entry (torch's traverse_state_dict): a dict, or a list that holds
    a tensor or something walked; a list of plain values is one value to it."""
    if isinstance(value, dict) or is_stateful(value):
        return True
    return isinstance(value, list) and any(isinstance(item, torch.Tensor) or _walked(item) for item in value)
