"""Decoder-only transformer (RMSNorm, rotary positions, causal SDPA) with MoE or dense FFNs."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.moe import FeedForward, GroupedExperts, MoE, MoEConfig, TopKRouter


@dataclass
class ModelConfig:
    vocab_size: int = 256  # byte-level tokens
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 256
    ffn_type: str = "moe"  # "moe" | "dense"
    dense_hidden_dim: int = 512  # dense FFN only
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # On each sublayer's output, in training: a draw from each rank's generator every step, so an
    # exact resume needs the generators restored (the bitwise resume test uses it).
    dropout: float = 0.0

    def validate(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "dense_hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim must be divisible by model.n_heads, got {self.dim} and {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"model.dim / model.n_heads must be even for rotary positions, got {self.dim // self.n_heads}")
        if self.ffn_type not in ("moe", "dense"):
            raise ValueError(f"model.ffn_type must be 'moe' or 'dense', got {self.ffn_type!r}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("model.norm_eps and model.rope_theta must be > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq_H = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles_TH = torch.outer(torch.arange(max_seq_len).float(), inv_freq_H)
    return angles_TH.cos(), angles_TH.sin()


def apply_rotary(x_BNTH: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of channels by its position's angle."""
    x1, x2 = x_BNTH.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([x1 * cos_TH - x2 * sin_TH, x1 * sin_TH + x2 * cos_TH], dim=-1)
    return rotated.flatten(-2).type_as(x_BNTH)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x_BTD: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = (w(x_BTD).view(B, T, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos_TH, sin_TH), apply_rotary(k, cos_TH, sin_TH)
        y_BNTH = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y_BNTH.transpose(1, 2).reshape(B, T, D))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MoE(cfg.dim, moe) if cfg.ffn_type == "moe" else FeedForward(cfg.dim, cfg.dense_hidden_dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD, cos_TH, sin_TH) -> tuple[torch.Tensor, torch.Tensor]:
        x_BTD = x_BTD + self.dropout(self.attention(self.attention_norm(x_BTD), cos_TH, sin_TH))
        if isinstance(self.feed_forward, MoE):
            ffn_BTD, aux_loss = self.feed_forward(self.ffn_norm(x_BTD))
        else:
            ffn_BTD, aux_loss = self.feed_forward(self.ffn_norm(x_BTD)), x_BTD.new_zeros((), dtype=torch.float32)
        return x_BTD + self.dropout(ffn_BTD), aux_loss


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig):
        super().__init__()
        self.cfg, self.moe_cfg = cfg, moe
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, moe) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos_TH, sin_TH = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos_TH, persistent=False)
        self.register_buffer("rope_sin", sin_TH, persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init, drawn in a fixed order from torch's global generator. Call it before
        `trainer.parallel.parallelize` so every rank starts from the same full weights."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)  # projections that add to the residual
        for name, module in self.named_modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=residual_std if name.endswith((".wo", ".w2")) else 0.02)
            elif isinstance(module, GroupedExperts):
                nn.init.normal_(module.w1_EDF, std=0.02)
                nn.init.normal_(module.w2_EFD, std=residual_std)
                nn.init.normal_(module.w3_EDF, std=0.02)
            elif isinstance(module, TopKRouter):
                module.expert_bias.zero_()

    def forward(self, tokens_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = tokens_BT.shape[1]
        cos_TH, sin_TH = self.rope_cos[:T], self.rope_sin[:T]
        x_BTD = self.tok_embeddings(tokens_BT)
        aux_loss = torch.zeros((), device=x_BTD.device)
        for layer in self.layers:
            x_BTD, layer_aux = layer(x_BTD, cos_TH, sin_TH)
            aux_loss = aux_loss + layer_aux
        return self.output(self.norm(x_BTD)).float(), aux_loss

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def moe_stats(self) -> dict:
        """Expert load of the last forward, summed over MoE layers and over all ranks.
        load_imbalance is max/mean tokens per expert of the worst layer (1.0 = balanced)."""
        loads = [m.last_load.float() for m in self.moe_layers() if m.last_load is not None]
        if not loads:
            return {"tokens_per_expert": torch.zeros(0), "load_imbalance": 1.0, "dropped_fraction": 0.0}
        load_LE = torch.stack(loads)[:, :-1]
        dropped = torch.stack(loads)[:, -1].sum()
        imbalance_L = load_LE.max(dim=1).values / load_LE.mean(dim=1).clamp(min=1e-9)
        return {
            "tokens_per_expert": load_LE.sum(dim=0).long().cpu(),
            "load_imbalance": imbalance_L.max().item(),
            "dropped_fraction": (dropped / load_LE.sum().clamp(min=1)).item(),
        }

    def num_params(self, active_only: bool = False) -> int:
        """Parameter count (global, also after sharding); active_only counts top_k of the experts."""
        total = sum(p.numel() for p in self.parameters())
        if active_only:
            inactive_share = 1 - self.moe_cfg.top_k / self.moe_cfg.num_experts
            total -= sum(int(p.numel() * inactive_share) for m in self.moe_layers() for p in m.experts.parameters())
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per active matmul weight plus causal attention (PaLM/torchtitan)."""
        matmul_params = self.num_params(active_only=True) - self.tok_embeddings.weight.numel()
        return 6 * matmul_params + 12 * self.cfg.n_layers * self.cfg.dim * seq_len
