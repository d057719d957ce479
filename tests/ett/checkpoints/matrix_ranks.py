"""One rank of the resume matrix (tests/ett/checkpoints/test_resume_matrix.py): a training loop on the library
whose state holds every kind a user's script passes, each kind its own small model:

    stateful   ett.ModelOptimizerState (a Stateful), AdamW
    nested     {"model": model.state_dict(), "optim": optimizer.state_dict()} as DCP's docs show
               them, taken anew for each save; the optimizer loaded from it after the restore
    plain      a tensor, a number, a string and a list of each rank's own, under a key of the
               rank's own (DCP keeps one copy of a plain value under a key every rank shares),
               and the same under a shared key, the same on every rank
    collapsed  a value of each rank's own under a shared key: a persistent restore names it
    fsdp       FSDP2 (DTensor shards): ett.ModelOptimizerState, and a second model's raw state_dict
    rng        ett.RNGState: dropout-like noise drawn from the global generator every step
    deep       Statefuls below the top: a position object of the script's own two levels down, an
               ett.ModelOptimizerState in a list (DCP would load a pickled copy in their place)

Ranks are plain processes over a file rendezvous, each its own "node" (LOCAL_WORLD_SIZE=1) with the
node-local folder `<base>/node-R`.

    python -m tests.ett.checkpoints.matrix_ranks BASE RANK WORLD PHASE TIER STEPS [HOLD_AT]

TIER: `persistent` (DCP every 5 steps through the node-local folder, no snapshots) or `snapshots`
(also a snapshot every step, copied to the peer). With HOLD_AT, rank 1 stops after that step's
save and waits to be killed (the test kills it once what it wants on disk is there). The state
of a first run (HOLD_AT given) has an entry `gone`, a resumed run's an entry `new`: each restore
must name both. Each rank writes its final tensors to `<base>/PHASE-rank-R.pt`.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ett
from ett.checkpoint import CheckpointConfig

DIM = 8


class Position:
    """A Stateful of the script's own (a data loader's position, say), kept below the top of the state."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))


def main() -> None:
    base, rank, world, phase, tier, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
    steps, hold_at = int(steps), int(sys.argv[7]) if len(sys.argv) > 7 else None
    dist.init_process_group("gloo", init_method=f"file://{base}/rendezvous-{phase}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same initial weights on every rank
    models = {name: net() for name in ("stateful", "nested", "fsdp", "fsdp_raw", "deep")}
    for name in ("fsdp", "fsdp_raw"):
        fully_shard(models[name], mesh=mesh)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items() if name != "fsdp_raw"}
    optimizers["fsdp_raw"] = torch.optim.SGD(models["fsdp_raw"].parameters(), lr=1e-2)  # no state of its own
    plain = {"w": torch.zeros(4), "position": 0, "tag": "start", "seen": [0, 0.0]}
    shared = {"w": torch.zeros(4), "position": 0, "tag": "start", "seen": [0, 0.0]}
    position = Position()
    torch.manual_seed(100 + rank)  # each rank its own noise

    def training_state() -> dict:
        state = {
            "stateful": ett.ModelOptimizerState(models["stateful"], optimizers["stateful"]),
            "nested": {"model": models["nested"].state_dict(), "optim": optimizers["nested"].state_dict()},
            "plain": {f"rank{rank}": plain},
            "shared": shared,
            "collapsed": {"saved_by": rank},
            "fsdp": ett.ModelOptimizerState(models["fsdp"], optimizers["fsdp"]),
            "fsdp_raw": {"model": models["fsdp_raw"].state_dict()},
            "rng": ett.RNGState(rank),
            "deep": {"data": {"position": position},
                     "parts": [ett.ModelOptimizerState(models["deep"], optimizers["deep"])]},
        }
        state["gone" if hold_at else "new"] = {"x": torch.ones(3)}
        return state

    with ett.init(checkpoint_dir=str(base / "ckpt")) as run:
        run.configure_checkpoints(CheckpointConfig(
            dir=str(base / "ckpt"), local_dir=str(base / f"node-{rank}"), interval_steps=5,
            snapshots=tier == "snapshots", snapshot_every=1))  # fmt: skip
        state = training_state()
        start = run.restore(state)
        if start:
            optimizers["nested"].load_state_dict(state["nested"]["optim"])
        for step in range(start + 1, steps + 1):
            with run.step(step):
                generator = torch.Generator().manual_seed(1_000_003 * step + rank)
                inputs_BD = torch.randn(8, DIM, generator=generator)
                noise_BD = torch.rand(8, DIM)  # the global generator: exact only if its state came back
                for name, model in models.items():
                    loss = F.mse_loss(model(inputs_BD * noise_BD), inputs_BD[:, :1].sin())
                    optimizers[name].zero_grad()
                    loss.backward()
                    if name in ("stateful", "nested", "deep"):  # not sharded: average their gradients by hand
                        for p in model.parameters():
                            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
                    optimizers[name].step()
                plain["w"] += noise_BD[0, :4]
                plain["position"], plain["tag"], plain["seen"] = step, f"step {step}", [step, float(noise_BD[0, 0])]
                shared["w"] += inputs_BD[0, :4] if rank == 0 else 0  # then the same on every rank
                dist.broadcast(shared["w"], src=0)
                shared["position"], shared["tag"], shared["seen"] = step, f"step {step}", [step, 0.5 * step]
                position.index += 3
            run.checkpoint(step, training_state(), force=step == steps)
            if step == hold_at and rank == 1:
                Path(base, f"held-{phase}").touch()
                time.sleep(600)  # killed here by the test
    final = {f"{name}.{key}": (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
             for name, model in models.items() for key, value in model.state_dict().items()}
    final |= {f"optim.{key}": value for key, value in optimizers["nested"].state_dict()["state"][0].items()}
    final |= {"plain": dict(plain), "shared": dict(shared), "rng": torch.get_rng_state()}
    final |= {"position": torch.tensor(position.index)}
    final |= {f"deep_optim.{key}": value for key, value in optimizers["deep"].state_dict()["state"][0].items()}
    torch.save(final, base / f"{phase}-rank-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    main()
