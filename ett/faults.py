"""Faults a rank's own code sets off, for tests and drills (docs/jobspec.md, "faults").

The agent hands each rank the `raise`, `fill_memory`, `fill_disk` and `slow` faults of its job that
are meant for its node, in ETT_FAULTS; `ett.Run` sets off the one of its rank as it enters the step:
- raise: the built-in exception named (RuntimeError by default) with the message, as a bug would;
- fill_memory: allocates until the memory runs out (a MemoryError under a cap, else the kernel's
  out-of-memory kill);
- fill_disk: writes into `path` until the file system is full, and raises what the write raised;
- slow: from `at_step` on, each step of the rank first sleeps (factor - 1) times its step before
  (its own sleep left out), before the step's synchronisation, as a slow data loader or a
  throttled device would: the rank runs `factor` times slower and its peers wait for it.
The agent's own faults (kill, hang, exit: agent/groups/faults.py) need no library.
"""

import builtins
import json
import os
from collections.abc import Mapping
from typing import Any

from ett.protocol import LIBRARY_FAULT_ACTIONS, JobEnv

CHUNK_BYTES = 64 << 20


def _rank_faults(rank: int, environ: Mapping[str, str]) -> list[dict[str, Any]]:
    """This rank's faults; none when the variable is absent or not a list of faults."""
    try:
        faults = json.loads(environ.get(JobEnv.FAULTS) or "[]")
    except ValueError:
        return []
    if not isinstance(faults, list):
        return []
    return [f for f in faults if isinstance(f, dict) and f.get("rank") == rank
            and f.get("action") in LIBRARY_FAULT_ACTIONS and isinstance(f.get("at_step"), int)]


def faults_of(rank: int, environ: Mapping[str, str] = os.environ) -> dict[int, dict[str, Any]]:
    """This rank's faults set off once, by step (all but `slow`)."""
    return {f["at_step"]: f for f in _rank_faults(rank, environ) if f["action"] != "slow"}


def slowdown_of(rank: int, environ: Mapping[str, str] = os.environ) -> tuple[int, float] | None:
    """This rank's `slow` fault: (from step, factor), or None."""
    for f in _rank_faults(rank, environ):
        if f["action"] == "slow" and isinstance(f.get("factor"), int | float) and f["factor"] > 1:
            return f["at_step"], float(f["factor"])
    return None


def set_off(fault: dict[str, Any], rank: int) -> None:
    """Carries the fault out; it raises (or the process dies)."""
    if fault["action"] == "raise":
        kind = getattr(builtins, fault.get("exception") or "RuntimeError", None)
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            kind = RuntimeError
        raise kind(fault.get("message") or "injected fault")
    if fault["action"] == "fill_memory":
        hog = []
        while True:
            chunk = bytearray(CHUNK_BYTES)
            chunk[:: 1 << 12] = b"x" * (CHUNK_BYTES >> 12)  # every page touched: really in memory
            hog.append(chunk)
    path = os.path.join(fault["path"], f"ett-fill-rank-{rank}")
    with open(path, "wb") as f:
        block = b"\0" * (1 << 20)
        while True:
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
