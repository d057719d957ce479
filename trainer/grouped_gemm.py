"""Routed SwiGLU experts: each assignment's token row runs through its expert's MLP, and the
result is added back, weighted, at the token's position.

The assignments s come sorted by expert, counts_E[e] of them for expert e; index_S[s] is the
row of x_TD they read and the row of the output they add to:

    out_TD[index_S[s]] += weights_S[s] * (silu(x w1[e]) * x w3[e]) w2[e],  x = x_TD[index_S[s]]

On CUDA `torch._grouped_mm` runs each matmul for all experts in one kernel (bf16, 16-byte
aligned rows), between a full-size gather and a full-size sum back. Where every row is read the
same number of times (no assignment dropped), that sum is a gather and a reshaped sum, in the
forward and in the gather's backward: a scatter-add there adds bf16 rows atomically, which was the
layer's largest kernel on an H200 (17% of its CUDA time, above each grouped matmul; see
bench/gpu/moe_profile.py). Elsewhere (CPU) one
autograd Function loops over the experts and, for each, gathers its rows, runs its MLP and adds
the weighted result back while the rows are still in cache, and does the same in the backward:
no full-size passes, and only the two pre-activations saved. Both paths run the same per-expert
matmuls, so the numerics match up to kernel rounding.
"""

import torch
import torch.nn.functional as F


def grouped_mm_supported(x_TK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    """True where `torch._grouped_mm` has a fast kernel: CUDA, bf16, rows aligned to 16 bytes."""
    aligned = all(n * x_TK.element_size() % 16 == 0 for n in (w_EKN.shape[1], w_EKN.shape[2]))
    return x_TK.is_cuda and x_TK.dtype == w_EKN.dtype == torch.bfloat16 and aligned


def gather_rows(x_TD: torch.Tensor, index_S: torch.Tensor, reads_per_row: int | None) -> torch.Tensor:
    """x_TD.index_select(0, index_S). reads_per_row: every row of x_TD appears exactly that many
    times in index_S (None: not known), which lets the backward gather instead of scatter-add."""
    if reads_per_row is None:
        return x_TD.index_select(0, index_S)  # backward: one index_add
    return _GatherRows.apply(x_TD, index_S, reads_per_row)


def sum_rows(y_SD: torch.Tensor, index_S: torch.Tensor, num_rows: int, reads_per_row: int | None) -> torch.Tensor:
    """out[index_S[s]] += y_SD[s] for num_rows output rows: the adjoint of gather_rows."""
    if reads_per_row is None:
        return y_SD.new_zeros(num_rows, y_SD.shape[1]).index_add(0, index_S, y_SD)
    return _SumRows.apply(y_SD, index_S, reads_per_row)


def _sum_by_row(y_SD: torch.Tensor, index_S: torch.Tensor, reads_per_row: int) -> torch.Tensor:
    """Each row's reads_per_row entries, found by a stable sort of index_S, gathered and summed."""
    by_row_S = torch.argsort(index_S, stable=True)
    return y_SD.index_select(0, by_row_S).view(-1, reads_per_row, y_SD.shape[1]).sum(dim=1)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, index_S, reads_per_row: int):
        ctx.save_for_backward(index_S)
        ctx.reads_per_row = reads_per_row
        return x_TD.index_select(0, index_S)

    @staticmethod
    def backward(ctx, grad_SD):
        (index_S,) = ctx.saved_tensors
        return _sum_by_row(grad_SD, index_S, ctx.reads_per_row), None, None


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_SD, index_S, reads_per_row: int):
        ctx.save_for_backward(index_S)
        return _sum_by_row(y_SD, index_S, reads_per_row)

    @staticmethod
    def backward(ctx, grad_TD):
        (index_S,) = ctx.saved_tensors
        return grad_TD.index_select(0, index_S), None, None


def routed_swiglu(
    x_TD: torch.Tensor,
    index_S: torch.Tensor,
    weights_S: torch.Tensor | None,
    w1_EDF: torch.Tensor,
    w2_EFD: torch.Tensor,
    w3_EDF: torch.Tensor,
    counts_E: torch.Tensor,
    use_grouped_mm: bool | None = None,
    reads_per_row: int | None = None,
) -> torch.Tensor:
    """out_TD (shaped like x_TD) as in the module docstring; weights_S None means all ones.
    reads_per_row: see gather_rows (top-k without drops: k; a permutation: 1).

    use_grouped_mm: None picks `torch._grouped_mm` where `grouped_mm_supported`; True forces it
    (PyTorch also has a CPU kernel, used by the tests); False forces the per-expert loop.
    """
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x_TD, w1_EDF)
    if not use_grouped_mm:
        return _SliceLoopRoutedSwiGLU.apply(x_TD, index_S, weights_S, w1_EDF, w2_EFD, w3_EDF, counts_E.tolist())
    x_SD = gather_rows(x_TD, index_S, reads_per_row)
    offsets_E = counts_E.cumsum(0).to(torch.int32)
    h_SF = F.silu(torch._grouped_mm(x_SD, w1_EDF, offs=offsets_E)) * torch._grouped_mm(x_SD, w3_EDF, offs=offsets_E)
    y_SD = torch._grouped_mm(h_SF, w2_EFD, offs=offsets_E)
    if weights_S is not None:
        y_SD = y_SD * weights_S.unsqueeze(-1)
    return sum_rows(y_SD, index_S, x_TD.shape[0], reads_per_row)


class _SliceLoopRoutedSwiGLU(torch.autograd.Function):
    """One expert at a time: gather its rows, run its MLP, weight, add back; matmuls written
    straight into the gradient buffers. The routing weight scales the hidden activations (the
    smaller side in fine-grained MoE) rather than the output. Saves only the two
    pre-activations; the backward gathers the rows again and recomputes silu. Experts with zero
    rows get a zero weight gradient, so every rank reduces the same set of tensors."""

    @staticmethod
    def forward(ctx, x_TD, index_S, weights_S, w1_EDF, w2_EFD, w3_EDF, counts: list[int]) -> torch.Tensor:
        a_SF, b_SF = x_TD.new_empty(2, index_S.shape[0], w1_EDF.shape[2])  # x w1 (gate), x w3 (up)
        out_TD = torch.zeros_like(x_TD)
        weight_slices = weights_S.split(counts) if weights_S is not None else [None] * len(counts)
        slices = zip(index_S.split(counts), weight_slices, a_SF.split(counts), b_SF.split(counts), strict=True)
        for e, (index_n, weights_n, a_nF, b_nF) in enumerate(slices):
            x_nD = x_TD.index_select(0, index_n)
            torch.mm(x_nD, w1_EDF[e], out=a_nF)
            torch.mm(x_nD, w3_EDF[e], out=b_nF)
            h_nF = F.silu(a_nF).mul_(b_nF)
            if weights_n is not None:
                h_nF.mul_(weights_n.unsqueeze(-1))
            out_TD.index_add_(0, index_n, h_nF @ w2_EFD[e])
        ctx.save_for_backward(x_TD, index_S, weights_S, a_SF, b_SF, w1_EDF, w2_EFD, w3_EDF)
        ctx.counts = counts
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD: torch.Tensor):
        x_TD, index_S, weights_S, a_SF, b_SF, w1_EDF, w2_EFD, w3_EDF = ctx.saved_tensors
        counts = ctx.counts
        grad_w1_EDF, grad_w2_EFD, grad_w3_EDF = (torch.empty_like(w) for w in (w1_EDF, w2_EFD, w3_EDF))
        grad_x_TD = torch.zeros_like(x_TD) if ctx.needs_input_grad[0] else None
        grad_weights_S = torch.empty_like(weights_S) if ctx.needs_input_grad[2] else None
        weight_slices = weights_S.split(counts) if weights_S is not None else [None] * len(counts)
        grad_weight_slices = grad_weights_S.split(counts) if grad_weights_S is not None else [None] * len(counts)
        slices = zip(index_S.split(counts), weight_slices, grad_weight_slices, a_SF.split(counts), b_SF.split(counts), strict=True)
        for e, (index_n, weights_n, grad_weights_n, a_nF, b_nF) in enumerate(slices):
            x_nD = x_TD.index_select(0, index_n)
            grad_y_nD = grad_out_TD.index_select(0, index_n)
            silu_nF = F.silu(a_nF)
            h_nF = silu_nF * b_nF
            grad_h_nF = grad_y_nD @ w2_EFD[e].t()  # before weighting
            if grad_weights_n is not None:
                # <y_s, grad_out[index_s]> with y_s = h_s w2[e], taken on the hidden side: no saved y.
                torch.sum(h_nF * grad_h_nF, dim=1, out=grad_weights_n)
            if weights_n is not None:
                h_nF.mul_(weights_n.unsqueeze(-1))
                grad_h_nF.mul_(weights_n.unsqueeze(-1))
            torch.mm(h_nF.t(), grad_y_nD, out=grad_w2_EFD[e])
            grad_a_nF = torch.ops.aten.silu_backward(grad_h_nF * b_nF, a_nF)
            grad_b_nF = grad_h_nF.mul_(silu_nF)
            torch.mm(x_nD.t(), grad_a_nF, out=grad_w1_EDF[e])
            torch.mm(x_nD.t(), grad_b_nF, out=grad_w3_EDF[e])
            if grad_x_TD is not None:
                grad_x_nD = grad_a_nF @ w1_EDF[e].t()
                grad_x_TD.index_add_(0, index_n, grad_x_nD.addmm_(grad_b_nF, w3_EDF[e].t()))
        return grad_x_TD, None, grad_weights_S, grad_w1_EDF, grad_w2_EFD, grad_w3_EDF, None
