"""A training script on the library with FSDP2 (fully_shard) and nothing else of ETT's but the
step: `torchrun --nproc-per-node 2 -m tests.ett.fsdp_ranks STEPS SLOW_RANK SLOW_SECONDS`.
SLOW_RANK sleeps SLOW_SECONDS in each block's forward, as a slow device would compute
(tests/ett/test_compute_timing.py)."""

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import ett

BLOCKS = 4


class Block(nn.Module):
    def __init__(self, slow_seconds: float):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.slow_seconds = slow_seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.slow_seconds)
        return torch.relu(self.linear(x))


def main() -> None:
    steps, slow_rank, slow_seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(slow_seconds if rank == slow_rank else 0.0) for _ in range(BLOCKS)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with ett.init() as run:
        for step in range(1, steps + 1):
            with run.step(step):
                loss = model(torch.randn(8, 64)).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
