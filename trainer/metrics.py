"""The periodic metrics line of rank 0: loss, throughput, MFU (GPU), peak memory, expert load."""

import logging
import resource
import time

import torch

from trainer.log import LogConfig
from trainer.model import Transformer

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peak FLOP/s per device (vendor data sheets), matched on the device name;
# longer names first so "H100 PCIe" is not read as an SXM H100.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "GH200": 989e12,
    "H200": 989e12,
    "H100": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsLogger:
    def __init__(self, cfg: LogConfig, model: Transformer, seq_len: int, world_size: int, device: torch.device):
        self.cfg, self.model, self.device, self.world_size = cfg, model, device, world_size
        self.flops_per_token = model.flops_per_token(seq_len)
        self.peak_flops = peak_flops(device)
        self.tokens, self.since = 0, time.perf_counter()

    def record(self, step: int, tokens: int, loss: float, lr: float, grad_norm: float) -> None:
        self.tokens += tokens
        if step % self.cfg.interval_steps:
            return
        now = time.perf_counter()
        tokens_per_s = self.tokens / (now - self.since)
        self.tokens, self.since = 0, now
        mfu = ""
        if self.peak_flops:
            mfu = f" mfu {100 * self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size):.1f}%"
        stats = self.model.moe_stats()
        logger.info(
            "step %d loss %.4f lr %.2e grad_norm %.3f tokens/s %.0f%s peak_mem %.0f MiB expert_imbalance %.2f dropped %.2f%%",
            step, loss, lr, grad_norm, tokens_per_s, mfu, peak_memory_bytes(self.device) / 2**20,
            stats["load_imbalance"], 100 * stats["dropped_fraction"],
        )
