"""Mixture-of-experts feed-forward layer.

Tokens are routed top-k by an fp32 router, permuted by ONE sort by expert id, run through
stacked SwiGLU experts (trainer/grouped_gemm.py: a grouped GEMM on CUDA, a per-expert loop that
gathers, computes and adds back in cache on CPU), weighted and added back to their positions.
With expert parallelism the sorted tokens go to the rank that owns their expert through an
uneven all-to-all (with autograd) and come back the same way.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.grouped_gemm import gather_rows, routed_swiglu, sum_rows


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    expert_hidden_dim: int = 256
    capacity_factor: float | None = None  # None: dropless
    shared_expert: bool = False
    load_balance_coef: float = 0.01
    z_loss_coef: float = 0.001
    aux_free_bias: bool = False  # DeepSeek-V3 bias that steers selection toward underused experts
    bias_update_rate: float = 0.001
    # The experts' matmuls: None picks torch._grouped_mm where it has a fast kernel (CUDA, bf16,
    # 16-byte aligned rows) and the per-expert loop elsewhere; true forces it, false the loop.
    grouped_mm: bool | None = None

    def validate(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"moe.num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe.top_k must be in [1, moe.num_experts={self.num_experts}], got {self.top_k}")
        if self.expert_hidden_dim < 1:
            raise ValueError(f"moe.expert_hidden_dim must be >= 1, got {self.expert_hidden_dim}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"moe.capacity_factor must be > 0 or None (dropless), got {self.capacity_factor}")
        for name in ("load_balance_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe.{name} must be >= 0, got {getattr(self, name)}")


def expert_capacity(cfg: MoEConfig, num_tokens: int) -> int:
    """Assignments an expert keeps from one rank's batch: capacity_factor x its fair share."""
    return max(1, int(cfg.capacity_factor * num_tokens * cfg.top_k / cfg.num_experts))


@dataclass
class Routing:
    weights_TK: torch.Tensor  # fp32 gate weight of each chosen expert
    experts_TK: torch.Tensor  # chosen expert ids
    aux_loss: torch.Tensor  # load-balancing + z-loss, already scaled by their coefficients


class TopKRouter(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.num_experts, bias=False)
        # Only shifts which experts are selected, never the gate weights; saved with the model.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))

    def forward(self, x_TD: torch.Tensor) -> Routing:
        cfg = self.cfg
        logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        probs_TE = logits_TE.softmax(dim=-1)
        scores_TE = probs_TE + self.expert_bias if cfg.aux_free_bias else probs_TE
        experts_TK = scores_TE.topk(cfg.top_k, dim=-1).indices
        weights_TK = probs_TE.gather(-1, experts_TK)
        if cfg.top_k > 1:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)

        # Switch load balancing: E * sum_e (share of assignments to e) * (mean probability of e).
        counts_E = torch.bincount(experts_TK.flatten(), minlength=cfg.num_experts)
        share_E = counts_E.float() / experts_TK.numel()
        load_balance = cfg.num_experts * (share_E * probs_TE.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits_TE, dim=-1).square().mean()
        aux_loss = cfg.load_balance_coef * load_balance + cfg.z_loss_coef * z_loss
        return Routing(weights_TK, experts_TK, aux_loss)


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs as stacked weights; under expert parallelism they are DTensors
    sharded on dim 0 over the EP mesh, and each rank computes with its local slice."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.w1_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.use_grouped_mm: bool | None = None  # None: torch._grouped_mm where supported
        self.grad_scale = 1.0  # 1/ep under expert parallelism, see trainer.parallel.parallelize

    def forward(
        self,
        x_TD: torch.Tensor,
        index_S: torch.Tensor,
        weights_S: torch.Tensor | None,
        counts_E: torch.Tensor,
        reads_per_row: int | None = None,
    ) -> torch.Tensor:
        """out_TD[index_S[s]] += weights_S[s] * expert(x_TD[index_S[s]]), s sorted by expert,
        counts_E[e] rows for local expert e (see trainer.grouped_gemm.routed_swiglu)."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EDF, self.w2_EFD, self.w3_EDF))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        return routed_swiglu(x_TD, index_S, weights_S, w1, w2, w3, counts_E, self.use_grouped_mm, reads_per_row)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class FeedForward(nn.Module):
    """Dense SwiGLU MLP (the dense model's FFN and the MoE shared expert)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = TopKRouter(dim, cfg)
        self.experts = GroupedExperts(dim, cfg.expert_hidden_dim, cfg.num_experts)
        self.experts.use_grouped_mm = cfg.grouped_mm
        self.shared_expert = FeedForward(dim, cfg.expert_hidden_dim) if cfg.shared_expert else None
        # Set by trainer.parallel: the EP group exchanges tokens, the data-parallel group
        # sums the expert load (stats and the aux-free bias must agree on every rank).
        self.ep_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None
        # Last forward, summed over all ranks: assignments per expert (before dropping), then dropped ones.
        self.last_load: torch.Tensor | None = None

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        routing = self.router(x_TD)
        k, num_experts = self.cfg.top_k, self.cfg.num_experts

        # One stable sort by expert id; each assignment s is token order_S[s] // k.
        experts_A = routing.experts_TK.flatten()
        order_S = torch.argsort(experts_A, stable=True)
        counts_E = torch.bincount(experts_A, minlength=num_experts)
        if self.cfg.capacity_factor is not None:
            order_S, kept_counts_E = self._drop_over_capacity(order_S, counts_E, x_TD.shape[0])
            reads_per_row = None  # some tokens may have lost an assignment
        else:
            kept_counts_E, reads_per_row = counts_E, k
        token_S = order_S // k
        weights_S = routing.weights_TK.flatten()[order_S].to(x_TD.dtype)

        if self.ep_group is None:
            out_TD = self.experts(x_TD, token_S, weights_S, kept_counts_E, reads_per_row)
        else:
            out_TD = self._experts_parallel(x_TD, token_S, weights_S, kept_counts_E, reads_per_row)
        if self.shared_expert is not None:
            out_TD = out_TD + self.shared_expert(x_TD)

        self._update_load(counts_E, experts_A.numel() - order_S.numel())
        return out_TD.view_as(x_BTD), routing.aux_loss

    def _drop_over_capacity(
        self, order_S: torch.Tensor, counts_E: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the first `capacity` assignments of each expert in token order (the sort is stable)."""
        capacity = expert_capacity(self.cfg, num_tokens)
        starts_E = counts_E.cumsum(0) - counts_E
        rank_in_expert_S = torch.arange(order_S.numel(), device=order_S.device) - starts_E.repeat_interleave(counts_E)
        return order_S[rank_in_expert_S < capacity], counts_E.clamp(max=capacity)

    def _experts_parallel(
        self,
        x_TD: torch.Tensor,
        token_S: torch.Tensor,
        weights_S: torch.Tensor,
        counts_E: torch.Tensor,
        reads_per_row: int | None,
    ) -> torch.Tensor:
        """Send each assignment's token to the rank owning its expert, run the local experts, send
        the results back, and add them, weighted, to their tokens."""
        group = self.ep_group
        ep = dist.get_world_size(group)
        local_experts = self.cfg.num_experts // ep
        # recv_counts_RL[r, l]: tokens rank r sends to our local expert l.
        recv_counts_RL = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts_RL, counts_E, group=group)
        recv_counts_RL = recv_counts_RL.view(ep, local_experts)
        send_splits = counts_E.view(ep, local_experts).sum(dim=1).tolist()
        recv_splits = recv_counts_RL.sum(dim=1).tolist()

        x_SD = gather_rows(x_TD, token_S, reads_per_row)
        x_recv_RD = funcol.all_to_all_single_autograd(x_SD, recv_splits, send_splits, group)
        # Arrivals are ordered (source rank, local expert); the experts take them in the order
        # (local expert, source rank) and add each result back at its arrival row.
        local_ids_R = torch.arange(local_experts, device=x_TD.device).repeat(ep).repeat_interleave(recv_counts_RL.flatten())
        perm_R = torch.argsort(local_ids_R, stable=True)
        y_recv_RD = self.experts(x_recv_RD, perm_R, None, recv_counts_RL.sum(dim=0), reads_per_row=1)
        y_SD = funcol.all_to_all_single_autograd(y_recv_RD, send_splits, recv_splits, group)
        return sum_rows(y_SD * weights_S.unsqueeze(-1), token_S, x_TD.shape[0], reads_per_row)

    @torch.no_grad()
    def _update_load(self, counts_E: torch.Tensor, dropped: int) -> None:
        load = torch.cat([counts_E, counts_E.new_tensor([dropped])])
        if self.dp_group is not None:
            dist.all_reduce(load, group=self.dp_group)
        self.last_load = load
        if self.cfg.aux_free_bias and self.training:
            load_E = load[:-1].float()
            self.router.expert_bias += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)
