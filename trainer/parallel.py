"""Expert parallelism and ZeRO data parallelism for the Transformer (torchtitan's layout).

Mesh ("efsdp", "ep") over all ranks, with "dp" = the two flattened:
- dense parameters are sharded (ZeRO-2/3) or replicated (ZeRO-0/1) over "dp", all ranks;
- expert weights are DTensors sharded on the expert dim over "ep", and sharded or replicated
  over "efsdp", the ranks that hold the same experts.
ZeRO-3 = FSDP2, ZeRO-2 = FSDP2 without resharding after forward, ZeRO-1 = replicated params
(FSDP2's replicate: gradients all-reduced) with sharded Adam moments (ZeroOneAdamW),
ZeRO-0 = replicate with a plain AdamW.
"""

import math
from dataclasses import dataclass

import torch
import torch._dynamo  # noqa: F401  (see below)
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from trainer.model import Transformer
from trainer.moe import MoE

# torch._dynamo above: DTensor's first operation (distribute_tensor) imports it, 1.2 s of a rank's
# start-up on this CPU. Imported with this module, it is in the agent's warm server (agent/warm/server.py),
# so every rank forked from there starts without paying it (docs/agent.md, "Warm start").


@dataclass
class ParallelConfig:
    ep: int = 1  # expert-parallel degree; divides the world size and moe.num_experts
    zero: int = 3  # ZeRO stage 0-3
    mixed_precision: str = "bf16"  # "bf16" | "none"; bf16 applies on GPU only, CPU runs fp32

    def validate(self) -> None:
        if self.ep < 1:
            raise ValueError(f"parallel.ep must be >= 1, got {self.ep}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.mixed_precision not in ("bf16", "none"):
            raise ValueError(f"parallel.mixed_precision must be 'bf16' or 'none', got {self.mixed_precision!r}")


def build_mesh(cfg: ParallelConfig, world_size: int, device_type: str) -> DeviceMesh:
    if world_size % cfg.ep:
        raise ValueError(f"parallel.ep ({cfg.ep}) must divide the world size ({world_size})")
    return init_device_mesh(device_type, (world_size // cfg.ep, cfg.ep), mesh_dim_names=("efsdp", "ep"))


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig) -> nn.Module:
    """Shard a model that holds full, identical weights on every rank (after init_weights).

    Expert gradients are summed over the EP group by the all-to-all backward (each rank's
    tokens reach every expert), then averaged over "efsdp"; the experts scale their gradient
    by 1/ep (GroupedExperts.grad_scale) so the result is the mean over all ranks, like dense
    gradients. (FSDP2's set_gradient_divide_factor would do the same but needs PREMUL_SUM,
    which gloo lacks, and gave wrong expert gradients with ZeRO-2 on a one-rank efsdp mesh.)
    """
    dp_mesh = mesh._flatten("dp")  # all ranks
    for moe in model.moe_layers():
        moe.dp_group = dp_mesh.get_group()
        if cfg.ep > 1:
            apply_expert_parallel(moe, mesh["ep"])
    bf16 = cfg.mixed_precision == "bf16" and mesh.device_type == "cuda"
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    if cfg.zero >= 2:
        # FSDP2 shards dim 0 by default; experts already split dim 0 over "ep", so shard dim 1 there.
        expert_placement = (lambda param: Shard(1)) if cfg.ep > 1 else None
        shard = dict(reshard_after_forward=cfg.zero == 3, mp_policy=mp_policy)
        for block in model.layers:
            if isinstance(block.feed_forward, MoE):
                fully_shard(block.feed_forward.experts, mesh=mesh["efsdp"], shard_placement_fn=expert_placement, **shard)
            fully_shard(block, mesh=dp_mesh, **shard)
        fully_shard(model, mesh=dp_mesh, **shard)
    else:
        for block in model.layers:
            if isinstance(block.feed_forward, MoE):
                replicate(block.feed_forward.experts, mesh=mesh["efsdp"], mp_policy=mp_policy)
            replicate(block, mesh=dp_mesh, mp_policy=mp_policy)
        replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
    return model


def apply_expert_parallel(moe: MoE, ep_mesh: DeviceMesh) -> None:
    ep = ep_mesh.size()
    if moe.cfg.num_experts % ep:
        raise ValueError(f"moe.num_experts ({moe.cfg.num_experts}) must be divisible by parallel.ep ({ep})")
    for name, param in list(moe.experts.named_parameters()):
        # DTensor, so checkpoints know each rank holds different experts.
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
        moe.experts.register_parameter(name, nn.Parameter(sharded))
    moe.experts.grad_scale = 1 / ep
    moe.ep_group = ep_mesh.get_group()


def build_optimizer(
    model: nn.Module, cfg: ParallelConfig, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.zero == 1:
        return ZeroOneAdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)


class ZeroOneAdamW(torch.optim.Optimizer):
    """ZeRO-1 AdamW: parameters and gradients stay replicated (DTensors from `replicate`), the
    Adam moments are DTensors sharded over the ranks that replicate the parameter. Each rank
    updates its shard of the parameter and the shards are all-gathered back. The moments being
    DTensors, DCP saves and loads them like FSDP's."""

    def __init__(self, params: list[nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                placements = sharded_placements(p)
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p.detach().redistribute(placements=placements))
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
                shard = p.detach().redistribute(placements=placements)
                p_local, m, v = shard.to_local(), state["exp_avg"].to_local(), state["exp_avg_sq"].to_local()
                grad = p.grad.redistribute(placements=placements).to_local()
                state["step"] += 1
                step = state["step"].item()
                p_local.mul_(1 - lr * group["weight_decay"])
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                p_local.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
                p.copy_(shard.redistribute(placements=p.placements))
        return loss


def sharded_placements(p: DTensor) -> list[Placement]:
    """p's placements with its data-parallel Replicate dim turned into a shard of the first
    tensor dim not already sharded (dim 1 for experts, whose dim 0 is split over EP)."""
    if not isinstance(p, DTensor) or not isinstance(p.placements[0], Replicate):
        raise ValueError("ZeRO-1 expects parameters replicated by trainer.parallel.parallelize")
    taken = {placement.dim for placement in p.placements if isinstance(placement, Shard)}
    free_dim = next(d for d in range(p.ndim) if d not in taken)
    return [Shard(free_dim), *p.placements[1:]]
