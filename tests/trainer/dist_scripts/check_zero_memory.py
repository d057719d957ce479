"""Run under torchrun (gloo): bytes each rank holds for parameters, gradients and Adam state
under ZeRO stages 0-3 with expert parallelism, against what each stage should shard.

Replicated means "dense + experts / ep" (experts are always split by EP); sharded means
1/N of the whole model. Prints "OK zero-memory zero=Z ..." on rank 0 per stage.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from trainer.model import ModelConfig, Transformer
from trainer.moe import MoEConfig
from trainer.parallel import ParallelConfig, build_mesh, build_optimizer, parallelize

MODEL = ModelConfig(dim=64, n_layers=2, n_heads=2, max_seq_len=16, ffn_type="moe")
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32, shared_expert=True)


def local_bytes(tensors) -> int:
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def check(name: str, measured: int, expected: float, tolerance: float = 0.03) -> str:
    if abs(measured - expected) > tolerance * expected:
        raise AssertionError(f"{name}: {measured} bytes on rank {dist.get_rank()}, expected {expected:.0f}")
    return f"{name}={measured / expected:.3f}"


def measure_stage(zero: int, ep: int) -> str:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Transformer(MODEL, MOE)
    model.init_weights()
    expert_bytes = sum(local_bytes(m.experts.parameters()) for m in model.moe_layers())
    total_bytes = local_bytes(model.parameters())
    replicated = total_bytes - expert_bytes + expert_bytes / ep
    sharded = total_bytes / world

    cfg = ParallelConfig(ep=ep, zero=zero, mixed_precision="none")
    model = parallelize(model, build_mesh(cfg, world, "cpu"), cfg)
    optim = build_optimizer(model, cfg, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    tokens_BT = torch.randint(0, MODEL.vocab_size, (2, 16))
    logits_BTV, aux_loss = model(tokens_BT[:, :-1])
    in_forward = local_bytes(model.parameters())  # what the forward left materialised
    (F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten()) + aux_loss).backward()
    grads = local_bytes(p.grad for p in model.parameters())
    optim.step()
    params = local_bytes(model.parameters())
    # Adam keeps two moments per parameter; the per-parameter step counter is not state size.
    state = local_bytes(v for s in optim.state.values() for k, v in s.items() if k != "step")

    results = [
        check("params", params, replicated if zero <= 1 else sharded),
        check("params_in_forward", in_forward, sharded if zero == 3 else replicated),
        check("grads", grads, replicated if zero <= 1 else sharded),
        check("adam_state", state, 2 * (replicated if zero == 0 else sharded)),
    ]
    if zero == 3:
        results.append(check("params+state", params + state, 3 * total_bytes / world))
    return " ".join(results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        for zero in (0, 1, 2, 3):
            summary = measure_stage(zero, args.ep)
            if dist.get_rank() == 0:
                print(f"OK zero-memory zero={zero} ranks={dist.get_world_size()} ep={args.ep} {summary}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
