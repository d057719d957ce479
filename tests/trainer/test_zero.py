"""ZeRO stages shard what they should, measured on 4 gloo ranks with EP=2: bytes of
parameters (at rest and left materialised by the forward), gradients and Adam moments.

"replicated" is dense + experts / ep (experts are always split by EP); "sharded" is 1/N of
the whole model. Every figure must be within 3% of what its stage should hold.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.trainer.multiprocess import run_on_ranks
from trainer.model import ModelConfig, Transformer
from trainer.moe import MoEConfig
from trainer.parallel import ParallelConfig, build_mesh, build_optimizer, parallelize

MODEL = ModelConfig(dim=64, n_layers=2, n_heads=2, max_seq_len=16, ffn_type="moe")
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=32, shared_expert=True)
EP = 2


def local_bytes(tensors) -> int:
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_stage(zero: int) -> dict[str, float]:
    """Each figure divided by what the stage should hold on this rank (1.0 = exact)."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Transformer(MODEL, MOE)
    model.init_weights()
    expert_bytes = sum(local_bytes(m.experts.parameters()) for m in model.moe_layers())
    total_bytes = local_bytes(model.parameters())
    replicated = total_bytes - expert_bytes + expert_bytes / EP
    sharded = total_bytes / world

    cfg = ParallelConfig(ep=EP, zero=zero, mixed_precision="none")
    model = parallelize(model, build_mesh(cfg, world, "cpu"), cfg)
    optim = build_optimizer(model, cfg, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    tokens_BT = torch.randint(0, MODEL.vocab_size, (2, 16))
    logits_BTV, aux_loss = model(tokens_BT[:, :-1])
    in_forward = local_bytes(model.parameters())
    (F.cross_entropy(logits_BTV.flatten(0, 1), tokens_BT[:, 1:].flatten()) + aux_loss).backward()
    grads = local_bytes(p.grad for p in model.parameters())
    optim.step()
    params = local_bytes(model.parameters())
    # The per-parameter step counter is a scalar, not state that grows with the model.
    state = local_bytes(v for s in optim.state.values() for k, v in s.items() if k != "step")
    return {
        "params": params / (replicated if zero <= 1 else sharded),
        "params_in_forward": in_forward / (sharded if zero == 3 else replicated),
        "grads": grads / (replicated if zero <= 1 else sharded),
        "adam_state": state / (2 * (replicated if zero == 0 else sharded)),
        "params+state / (total / N)": (params + state) / (3 * sharded),
    }


def measure_all_stages() -> dict[int, dict[str, float]]:
    per_rank = {zero: measure_stage(zero) for zero in range(4)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_rank)
    return {zero: {name: [rank[zero][name] for rank in gathered] for name in per_rank[zero]} for zero in per_rank}


@pytest.mark.slow
def test_zero_stages_shard_params_grads_and_optimizer_state():
    ratios = run_on_ranks(measure_all_stages, 4, timeout=150)
    for zero, figures in ratios.items():
        checked = figures if zero == 3 else {k: v for k, v in figures.items() if k != "params+state / (total / N)"}
        for name, per_rank in checked.items():
            assert all(abs(r - 1) <= 0.03 for r in per_rank), f"zero={zero} {name}: {per_rank}"
    assert ratios[0]["params+state / (total / N)"][0] > 1.5  # ZeRO-0 really holds more (replicated dense)
