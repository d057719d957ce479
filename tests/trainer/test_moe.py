"""MoE layer: sorted grouped dispatch (torch._grouped_mm, and the CPU loop that gathers, computes
and adds back per expert) against the per-expert masked reference loop."""

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.grouped_gemm import gather_rows, routed_swiglu, sum_rows
from trainer.model import ModelConfig, Transformer
from trainer.moe import MoE, MoEConfig, expert_capacity

DIM = 16


def build_moe(seed: int = 0, **overrides) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_hidden_dim": 8, **overrides})
    moe = MoE(DIM, cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def reference_moe(moe: MoE, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral-style loop: for each expert, find its tokens by mask, run it, add weighted output.
    Capacity keeps an expert's first assignments in token order."""
    cfg, experts = moe.cfg, moe.experts
    routing = moe.router(x_TD)
    out_TD = torch.zeros_like(x_TD)
    for e in range(cfg.num_experts):
        token_idx, slot = torch.where(routing.experts_TK == e)
        if cfg.capacity_factor is not None:
            keep = expert_capacity(cfg, x_TD.shape[0])
            token_idx, slot = token_idx[:keep], slot[:keep]
        x_e = x_TD[token_idx]
        y_e = (F.silu(x_e @ experts.w1_EDF[e]) * (x_e @ experts.w3_EDF[e])) @ experts.w2_EFD[e]
        out_TD = out_TD.index_add(0, token_idx, y_e * routing.weights_TK[token_idx, slot].unsqueeze(-1))
    if moe.shared_expert is not None:
        out_TD = out_TD + moe.shared_expert(x_TD)
    return out_TD, routing.aux_loss


def forward_backward(moe: MoE, fn, x_TD: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    moe.zero_grad()
    x = x_TD.clone().requires_grad_()
    out, aux = fn(x)
    ((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + aux).backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    grads["input"] = x.grad
    return out.detach(), grads


@pytest.mark.parametrize("use_grouped_mm", [True, False], ids=["torch._grouped_mm", "fused-slice-loop"])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"capacity_factor": 0.5},
        {"capacity_factor": 1.0, "shared_expert": True, "top_k": 1},
        {"num_experts": 8, "aux_free_bias": True},  # expert 3 pushed out by its bias: zero tokens
    ],
    ids=["dropless", "capacity-0.5", "capacity-1-shared-top1", "empty-expert"],
)
def test_grouped_dispatch_matches_masked_loop(overrides, use_grouped_mm):
    moe = build_moe(**overrides)
    moe.eval()  # no aux-free bias update between the two runs
    moe.router.expert_bias[3] = -10.0
    moe.experts.use_grouped_mm = use_grouped_mm
    x_TD = torch.randn(24, DIM, generator=torch.Generator().manual_seed(1))

    out, grads = forward_backward(moe, lambda x: moe(x), x_TD)
    ref_out, ref_grads = forward_backward(moe, lambda x: reference_moe(moe, x), x_TD)

    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    load = moe.last_load
    if moe.cfg.aux_free_bias:
        assert load[3] == 0
        assert all(w.grad[3].abs().sum() == 0 for w in (moe.experts.w1_EDF, moe.experts.w2_EFD, moe.experts.w3_EDF))
    dropped = int(load[-1])
    if moe.cfg.capacity_factor is not None:
        capacity = expert_capacity(moe.cfg, 24)
        assert dropped == int((load[:-1] - capacity).clamp(min=0).sum()) and (capacity < 12 or dropped == 0)
    else:
        assert dropped == 0
    assert int(load[:-1].sum()) == 24 * moe.cfg.top_k


def test_unweighted_permutation_matches_grouped_mm():
    """The expert-parallel call: arrivals permuted into expert order, no routing weights, each
    result added back at its arrival row; one expert has no rows."""
    generator = torch.Generator().manual_seed(2)
    x_RD = torch.randn(10, DIM, generator=generator)
    weights = [torch.randn(3, *shape, generator=generator) * 0.3 for shape in ((DIM, 8), (8, DIM), (DIM, 8))]
    perm_R, counts_E = torch.randperm(10, generator=generator), torch.tensor([6, 0, 4])
    results = []
    for use_grouped_mm in (True, False):
        inputs = [t.clone().requires_grad_() for t in (x_RD, *weights)]
        out_RD = routed_swiglu(inputs[0], perm_R, None, *inputs[1:], counts_E, use_grouped_mm, reads_per_row=1)
        (out_RD * torch.linspace(-1, 1, out_RD.numel()).view_as(out_RD)).sum().backward()
        results.append([out_RD.detach(), *(t.grad for t in inputs)])
    for grouped, looped in zip(*results, strict=True):
        torch.testing.assert_close(looped, grouped, rtol=1e-5, atol=1e-6)
    _, _, *grad_weights = results[1]
    assert all(grad[1].abs().sum() == 0 for grad in grad_weights)  # expert 1 has no rows


def test_capacity_drops_tokens():
    moe = build_moe(capacity_factor=0.5)
    moe(torch.randn(32, DIM))
    assert moe.last_load[-1] >= 32 * 2 // 2  # at most half of the assignments fit


def test_uniform_router_aux_loss_is_exact():
    moe = build_moe(load_balance_coef=0.01, z_loss_coef=0.001)
    torch.nn.init.zeros_(moe.router.gate.weight)
    _, aux = moe(torch.randn(10, DIM))
    # Uniform probabilities: balance loss E * sum(f_e / E) = 1, z-loss log(E)^2.
    assert aux.item() == pytest.approx(0.01 + 0.001 * math.log(4) ** 2, rel=1e-6)


def test_aux_free_bias_moves_toward_underloaded_experts_and_only_steers_selection():
    moe = build_moe(aux_free_bias=True, bias_update_rate=0.1, num_experts=4, top_k=1)
    x_TD = torch.randn(40, DIM)
    probs_TE = moe.router.gate(x_TD).softmax(-1)
    moe.train()
    moe(x_TD)
    load_E = moe.last_load[:-1].float()
    expected = 0.1 * torch.sign(load_E.mean() - load_E)
    torch.testing.assert_close(moe.router.expert_bias, expected)

    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    moe.eval()
    routing = moe.router(x_TD)
    assert (routing.experts_TK == 2).all()  # the bias decides the choice...
    torch.testing.assert_close(routing.weights_TK[:, 0], probs_TE[:, 2].detach())  # ...not the gate weight
    moe(x_TD)
    assert moe.router.expert_bias[2] == 5.0  # no update in eval mode


@pytest.mark.parametrize(
    "cfg, message",
    [
        (MoEConfig(top_k=9), "moe.top_k"),
        (MoEConfig(capacity_factor=0.0), "moe.capacity_factor"),
        (MoEConfig(z_loss_coef=-1), "moe.z_loss_coef"),
        (ModelConfig(dim=30, n_heads=4), "model.dim must be divisible by model.n_heads"),
        (ModelConfig(ffn_type="sparse"), "model.ffn_type"),
    ],
)
def test_validation_names_the_field(cfg, message):
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def tiny_transformer(ffn_type: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(
        ModelConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=16, ffn_type=ffn_type, dense_hidden_dim=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden_dim=16, capacity_factor=1.0),
    )
    model.init_weights()
    return model


def test_transformer_forward_stats_and_counts():
    model = tiny_transformer("moe")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), tiny_transformer("moe").state_dict().values()))
    tokens_BT = torch.randint(0, 256, (2, 12))
    logits_BTV, aux = model(tokens_BT)
    assert logits_BTV.shape == (2, 12, 256) and aux.ndim == 0 and aux > 0
    stats = model.moe_stats()
    assert int(stats["tokens_per_expert"].sum()) == 2 * 24 * 2  # layers x tokens x top_k
    assert stats["load_imbalance"] >= 1.0 and 0.0 <= stats["dropped_fraction"] < 1.0
    expert_numel = 2 * 3 * 4 * 32 * 16
    assert model.num_params() - model.num_params(active_only=True) == expert_numel // 2
    assert model.flops_per_token(12) == 6 * (model.num_params(active_only=True) - 256 * 32) + 12 * 2 * 32 * 12

    dense = tiny_transformer("dense")
    _, dense_aux = dense(tokens_BT)
    assert dense_aux.item() == 0.0 and dense.moe_stats()["dropped_fraction"] == 0.0


@pytest.mark.parametrize("reads_per_row", [1, 2, 3])
def test_gather_and_sum_by_row_match_index_add_and_their_gradients(reads_per_row):
    """Rows each read reads_per_row times, in a shuffled order: the gather-and-sum path gives the
    scatter-add's values and gradients (float64 gradcheck), and sum_rows is gather_rows' adjoint."""
    generator = torch.Generator().manual_seed(3)
    index_S = torch.arange(5).repeat(reads_per_row)[torch.randperm(5 * reads_per_row, generator=generator)]
    x_TD = torch.randn(5, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    y_SD = torch.randn(5 * reads_per_row, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    torch.testing.assert_close(gather_rows(x_TD, index_S, reads_per_row), gather_rows(x_TD, index_S, None))
    torch.testing.assert_close(sum_rows(y_SD, index_S, 5, reads_per_row), sum_rows(y_SD, index_S, 5, None))
    assert torch.autograd.gradcheck(lambda x: gather_rows(x, index_S, reads_per_row), (x_TD,))
    assert torch.autograd.gradcheck(lambda y: sum_rows(y, index_S, 5, reads_per_row), (y_SD,))
    inner_gathered = (gather_rows(x_TD, index_S, reads_per_row) * y_SD).sum()
    inner_summed = (x_TD * sum_rows(y_SD, index_S, 5, reads_per_row)).sum()
    torch.testing.assert_close(inner_gathered, inner_summed)
