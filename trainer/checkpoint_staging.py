"""Staging for asynchronous checkpoints: the one copy of the state that blocks the training loop.

Every tensor of the state dict is copied into a CPU buffer kept under the tensor's place in the
dict (its key path). The buffers are allocated by the first save and reused by every later one,
so a save is a walk over the dict and one `copy_` per tensor. DCP's DefaultStager reaches the
same buffers through a deep copy of the whole dict: a new tensor object per tensor, a storage
lookup in a weak dictionary, DTensors rebuilt through their pickling hooks. On the ~1 GB state
of bench/checkpoint_save.py that took a quarter of the time the loop waited.

The caller must not stage again before the previous save is written (the buffers are reused).
"""

import copy

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


class ReusedBufferStager(AsyncStager):
    """share_memory: buffers in shared memory, for DCP's checkpoint process; pin_memory: page-locked
    buffers (registered with CUDA), so the copy from the GPU runs at full speed."""

    _synchronize_after_execute = False  # stage() returns once the copy is done: nothing to wait for

    def __init__(self, share_memory: bool, pin_memory: bool):
        self.share_memory, self.pin_memory = share_memory, pin_memory
        self.buffers: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def stage(self, state_dict: dict) -> dict:
        return self._stage(state_dict, ())

    def _stage(self, value, path: tuple):
        if isinstance(value, DTensor):  # same sharding, local shard staged
            return DTensor(self._stage_tensor(value._local_tensor, path), value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            return self._stage_tensor(value, path)
        if isinstance(value, dict):  # OrderedDict too (module state dicts)
            return {key: self._stage(item, (*path, key)) for key, item in value.items()}
        if isinstance(value, list) or type(value) is tuple:
            return type(value)(self._stage(item, (*path, i)) for i, item in enumerate(value))
        return copy.deepcopy(value)  # step counters, data position: small, and the loop changes them

    def _stage_tensor(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            self._release(path)
            buffer = self.buffers[path] = self._allocate(tensor)
        buffer.copy_(tensor)
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
        pass  # staging is synchronous

    def close(self) -> None:
        for path in list(self.buffers):
            self._release(path)
