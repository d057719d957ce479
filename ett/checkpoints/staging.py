"""Staging for asynchronous checkpoints: the copy of the state into CPU memory, overlapped with
the next step's forward and backward.

Every tensor of the state dict is copied into a CPU buffer kept under the tensor's place in the
dict (its key path). The buffers are allocated by the first save and reused by every later one,
so a save is a walk over the dict and one `copy_` per tensor. (DCP's DefaultStager reaches the
same buffers through a deep copy of the whole dict, which cost a quarter of the blocking time on
the ~1 GB state of bench/checkpoint_save.py.)

Parameters and optimizer state change only in `optimizer.step`: `stage` copies them in a
background thread (`copy_` releases the GIL) and the training loop calls `wait_for_copies()`
before its next `optimizer.step`, as torchtitan's `maybe_wait_for_staging`. From a GPU they are
copied on a CUDA stream of their own: on the training stream the copy would queue between the
next forward's kernels and hold them up. Everything else
changes elsewhere (model buffers such as the MoE router's `expert_bias` in the forward, RNG
states, data position, step) and is copied before `stage` returns.

The caller must not stage again before the previous save is written (the buffers are reused).
"""

import copy
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _storage_key(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage().data_ptr()


class ReusedBufferStager(AsyncStager):
    """share_memory: buffers in shared memory, for DCP's checkpoint process; pin_memory: page-locked
    buffers (registered with CUDA), so the copy from the GPU runs at full speed."""

    def __init__(self, share_memory: bool, pin_memory: bool):
        self.share_memory, self.pin_memory = share_memory, pin_memory
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ett-ckpt-stage")
        self._background: set[int] = set()  # storages of the tensors copied in the background
        self.copies: Future | None = None  # the last stage's: its staged dict, or the copy's error
        self.stream: torch.cuda.Stream | None = None  # the background copies' (CUDA tensors)

    def copy_in_background(self, tensors: Iterable[torch.Tensor]) -> None:
        """The next `stage` copies these (and views of them) in the background: only the
        optimizer step may change them, and only after `wait_for_copies()`."""
        self._background = {_storage_key(t) for t in tensors}

    @torch.no_grad()
    def stage(self, state_dict: dict) -> Future[dict]:
        """Copy now every tensor not marked by `copy_in_background`; return the staged dict,
        as a future that completes when the background copies are done too."""
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = self._stage(state_dict, (), later)
        self._background = set()
        self.copies = self.copier.submit(self._copy_all, later, staged, self._copy_stream(later))
        return self.copies

    def _copy_stream(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Stream | None:
        """The stream for the background copies from a GPU, made to start after everything the
        training stream has queued so far (the optimizer step that wrote the tensors)."""
        device = next((tensor.device for _, tensor in pairs if tensor.is_cuda), None)
        if device is None:
            return None
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        return self.stream

    @staticmethod
    @torch.no_grad()
    def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], staged: dict, stream: torch.cuda.Stream | None) -> dict:
        with torch.cuda.stream(stream):  # None: no GPU tensors, a no-op
            for buffer, tensor in pairs:
                buffer.copy_(tensor, non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()  # the copies are done before wait_for_copies() returns
        return staged

    def wait_for_copies(self) -> None:
        """Block until the background copies of the last `stage` are done; a failure of theirs
        is not raised here but by the future `stage` returned."""
        if self.copies is not None:
            self.copies.exception()

    def _stage(self, value, path: tuple, later: list):
        if isinstance(value, DTensor):  # same sharding, local shard staged
            return DTensor(self._stage_tensor(value, path, later), value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            return self._stage_tensor(value, path, later)
        if isinstance(value, dict):  # OrderedDict too (module state dicts)
            return {key: self._stage(item, (*path, key), later) for key, item in value.items()}
        if isinstance(value, list) or type(value) is tuple:
            return type(value)(self._stage(item, (*path, i), later) for i, item in enumerate(value))
        return copy.deepcopy(value)  # step counters, data position: small, and the loop changes them

    def _stage_tensor(self, tensor: torch.Tensor, path: tuple, later: list) -> torch.Tensor:
        local = _local(tensor)
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            self._release(path)
            buffer = self.buffers[path] = self._allocate(local)
        if _storage_key(local) in self._background:
            later.append((buffer, local))
        else:
            buffer.copy_(local)
        return buffer

    def _allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
        if self.share_memory:
            buffer.share_memory_()
        if self.pin_memory and buffer.nbytes:
            pin_memory_utils.pin_memory(buffer.data_ptr(), buffer.nbytes)
        return buffer

    def _release(self, path: tuple) -> None:
        buffer = self.buffers.pop(path, None)
        if buffer is not None and self.pin_memory and buffer.nbytes:
            pin_memory_utils.unpin_memory(buffer.data_ptr())

    def synchronize_staging(self) -> None:
        self.wait_for_copies()

    def close(self) -> None:
        self.wait_for_copies()
        self.copier.shutdown()
        for path in list(self.buffers):
            self._release(path)
