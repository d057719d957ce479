"""Run a test function on N local ranks that form a real gloo process group.

The ranks are forked from the test process, so they inherit its imports: a spawned or
torchrun rank spends ~10 s of CPU importing torch.distributed before doing anything.
"""

import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable

import torch
import torch._dynamo  # noqa: F401  imported lazily by the first optimizer: once here, not once per rank
import torch.distributed as dist

from tests.support.postgres import free_port


def run_on_ranks(fn: Callable, nproc: int, *args, timeout: float = 120):
    """Call fn(*args) on every rank; return rank 0's result. Raises with the failing rank's traceback."""
    ctx = multiprocessing.get_context("fork")
    reports = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ranks = [ctx.Process(target=_rank_main, args=(fn, args, rank, nproc, init_method, reports)) for rank in range(nproc)]
    for process in ranks:
        process.start()
    try:
        deadline, results = time.monotonic() + timeout, {}
        while len(results) < nproc:
            try:
                rank, ok, value = reports.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{fn.__name__} on {nproc} ranks: no answer from ranks {set(range(nproc)) - set(results)} after {timeout} s")
            if not ok:
                raise AssertionError(f"{fn.__name__} failed on rank {rank} of {nproc}:\n{value}")
            results[rank] = value
        return results[0]
    finally:
        for process in ranks:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def _rank_main(fn, args, rank, nproc, init_method, reports) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=nproc)
        try:
            reports.put((rank, True, fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        reports.put((rank, False, traceback.format_exc()))
