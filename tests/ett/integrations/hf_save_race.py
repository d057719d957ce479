"""Two ranks save a Trainer checkpoint as the Trainer does, rank 1 a second late with its part
(each rank writes its own RNG state); both then call ETTCallback.on_save. The commit marker must
list both parts (tests/ett/integrations/test_huggingface.py).

    torchrun --nproc-per-node 2 -m tests.ett.integrations.hf_save_race OUTPUT_DIR
"""

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

import ett
from ett.integrations.huggingface import ETTCallback

STEP = 5


def main(output_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = Path(output_dir) / f"checkpoint-{STEP}"
    folder.mkdir(parents=True, exist_ok=True)
    with ett.init() as run:
        callback = ETTCallback(run)
        if rank == 1:
            time.sleep(1.0)  # a rank slow to write its part
        (folder / f"rng_state_{rank}.pth").write_bytes(bytes(64))
        state = SimpleNamespace(global_step=STEP, is_world_process_zero=rank == 0)
        callback.on_save(SimpleNamespace(output_dir=output_dir), state, SimpleNamespace())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
