"""Entries DCP takes as the same on every rank, checked at each save of the persistent tier.

DCP saves a plain tensor (not a DTensor) once, from one rank, and a plain value (a number, a
string) from rank 0: it takes both as replicated. A per-rank value under a key every rank
shares (a data position, a per-rank counter, a generator's state) then comes back on every rank as
one rank's copy: a resume wrong without a word. (The snapshot tiers keep each rank's own.)

So at each save every rank takes a CRC-32 of each such entry (plain values, and CPU tensors of
at most MAX_CHECKED_BYTES: weights replicated by DDP are large, the same by design and on the
GPU, and are not read); the commit's gather (ett/checkpoints/tiers.py) brings them to rank 0,
which names the keys whose values differ in the log, the `ckpt_committed` event and the
manifest (`differs_across_ranks`); a restore of that checkpoint names them again
(ett/checkpoints/state_load.py). An entry of each rank's own goes under a key of its own, as ett.RNGState's.
"""

import pickle
import zlib
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor


MAX_CHECKED_BYTES = 1 << 20
MANIFEST_KEY = "differs_across_ranks"
REPORTED_KEYS = 20  # named in an event or a log line; the counts say how many more


def digests(state: dict[str, Any], skip: set[str]) -> dict[str, int]:
    """CRC-32 of each entry DCP keeps one copy of, by DCP name. `state`: as DCP saves it (each
    Stateful's state_dict taken); the entries of `skip` (ett.ModelOptimizerState's model and
    optimizer: sharded, or replicated by design) are not read. An entry that cannot be read so
    is not checked: the save goes on."""
    flat, _ = flatten_state_dict({key: value for key, value in state.items() if key not in skip})
    found = {}
    for key, value in flat.items():
        try:
            if isinstance(value, DTensor):
                continue
            if isinstance(value, torch.Tensor):
                if value.device.type == "cpu" and value.nbytes <= MAX_CHECKED_BYTES:
                    found[key] = zlib.crc32(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            else:
                found[key] = zlib.crc32(pickle.dumps(value))
        except Exception:  # a sparse tensor, an object pickle cannot take: DCP may still save it
            continue
    return found


def differing(per_rank: list[dict[str, int]]) -> list[str]:
    """The keys whose digests differ between ranks."""
    seen: dict[str, set[int]] = {}
    for rank_digests in per_rank:
        for key, digest in rank_digests.items():
            seen.setdefault(key, set()).add(digest)
    return sorted(key for key, values in seen.items() if len(values) > 1)


def named(keys: list[str]) -> str:
    """The first REPORTED_KEYS of `keys`, for a log line."""
    return ", ".join(keys[:REPORTED_KEYS]) + (", ..." if len(keys) > REPORTED_KEYS else "")


def describe(keys: list[str]) -> str:
    """Why these keys will not resume as they were: one line, for the save's log and the restore's."""
    return (f"{len(keys)} entries differed between ranks, and a persistent checkpoint holds one rank's copy "
            f"of a plain tensor or value (DCP takes them as the same on every rank): {named(keys)}; give each "
            "rank's own value a key of its own, as ett.RNGState does")
