"""Where DCP writes a checkpoint in the background: a checkpoint process per rank, or a thread.

Process-based saving keeps serialisation and file writes off the training process's GIL, at the
price of a process spawned in every attempt that imports torch: seconds of CPU per rank, which on a
busy node the steps around a job's first save pay (the demo's step after its first save took 4.6 s
instead of 0.2 s). A thread pays only serialisation under the GIL, which bench/checkpoint_save.py
found no costlier than the process at 1 GB per rank (BENCHMARKS.md, "Checkpoint save"). So `auto`
takes the process only for a rank's state of PROCESS_MIN_BYTES or more.
"""

import contextlib
import logging
import os
import shutil
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _async_process_executor
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)
ASYNC_MODES = ("auto", "process", "thread")
PROCESS_MIN_BYTES = 1 << 30
# At close, with every save committed: DCP's checkpoint process is asked to exit and given this
# long, then killed (its own shutdown took 1 s on 2 cores, the last second of every job).
CHECKPOINT_PROCESS_EXIT_SECONDS = 0.1


def tensor_bytes(state: dict) -> int:
    """Bytes of this rank's tensors in a state dict, as DCP saves it (each Stateful's state_dict taken)."""
    total, stack = 0, [state]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
        elif isinstance(value, torch.Tensor):
            total += (value.to_local() if isinstance(value, DTensor) else value).nbytes
    return total


def agree_on_mode(async_mode: str, state: dict, group: dist.ProcessGroup) -> AsyncCheckpointerType:
    """The writer for `async_mode` (one of ASYNC_MODES) and this state, the same on every rank of
    `group` (a collective): the checkpoint processes form one group. Process-based saving stages
    into shared memory, which containers often cap (Docker: 64 MiB of /dev/shm); where a rank's
    state does not fit, every rank saves from a thread instead."""
    if async_mode == "thread":
        return AsyncCheckpointerType.THREAD
    local_bytes = tensor_bytes(state)
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    fits = 3 * shm_free > 4 * local_bytes  # a third to spare
    if not fits:
        logger.warning("checkpoint.async_mode: /dev/shm has %d MiB free, too little for process-based "
                       "saving of %d MiB of state; saving from a thread instead", shm_free >> 20, local_bytes >> 20)
    worth_it = async_mode == "process" or local_bytes >= PROCESS_MIN_BYTES
    agreed = torch.tensor([int(fits and worth_it)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    mode = AsyncCheckpointerType.PROCESS if agreed.item() else AsyncCheckpointerType.THREAD
    logger.info("checkpoint.async_mode %s: saving from a %s (%d MiB of state on this rank)", async_mode, mode.value,
                local_bytes >> 20)
    return mode


def stop_checkpoint_process() -> None:
    """Stops DCP's checkpoint process of this process, if it has one. DCP has no public call for it:
    ask it to exit, and kill it if it is slow to; the caller has committed every save, and a rank
    must not leave it behind. DCP keeps one per process: forgotten, a later process-based save
    starts its own instead of writing to a dead pipe."""
    daemon = _async_process_executor._CHECKPOINT_PROCESS
    if daemon is None:
        return
    started = time.monotonic()
    with contextlib.suppress(OSError):  # it died already
        daemon._send(_async_process_executor._CheckpointSaveProcessControlOpts.TERMINATE)
    daemon._save_process.join(timeout=CHECKPOINT_PROCESS_EXIT_SECONDS)
    if daemon._save_process.is_alive():
        daemon._save_process.kill()
        daemon._save_process.join()
    _async_process_executor._CHECKPOINT_PROCESS = None
    logger.info("checkpoint process gone in %.2f s", time.monotonic() - started)
