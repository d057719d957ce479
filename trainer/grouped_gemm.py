"""Grouped GEMM over tokens sorted by expert: one matmul per contiguous group of rows.

`torch._grouped_mm` runs every group in one kernel on CUDA (bf16, 16-byte aligned rows).
Elsewhere the same product is computed by a loop over the contiguous slices of the sorted
tokens; both give per-group `x_e @ w[e]`, so the numerics match up to kernel rounding.
"""

import torch
import torch.nn.functional as F


def grouped_mm_supported(x_SK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    """True where `torch._grouped_mm` has a fast kernel: CUDA, bf16, rows aligned to 16 bytes."""
    aligned = all(n * x_SK.element_size() % 16 == 0 for n in (w_EKN.shape[1], w_EKN.shape[2]))
    return x_SK.is_cuda and x_SK.dtype == w_EKN.dtype == torch.bfloat16 and aligned


def grouped_mm(
    x_SK: torch.Tensor,
    w_EKN: torch.Tensor,
    counts_E: torch.Tensor,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """Rows of x_SK are grouped by expert (counts_E rows each, in expert order); returns x_e @ w[e].

    use_grouped_mm: None picks `torch._grouped_mm` where `grouped_mm_supported`; True forces it
    (PyTorch also has a CPU kernel, used by the tests); False forces the slice loop.
    """
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x_SK, w_EKN)
    if use_grouped_mm:
        offsets_E = counts_E.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x_SK, w_EKN, offs=offsets_E)
    return _SliceLoopMM.apply(x_SK, w_EKN, counts_E.tolist())


class _SliceLoopMM(torch.autograd.Function):
    """One matmul per expert over its contiguous slice of rows, written straight into the output
    and into the gradient buffers (no per-expert temporaries to concatenate or stack). Experts
    with zero rows get a zero weight gradient, so every rank reduces the same set of tensors."""

    @staticmethod
    def forward(ctx, x_SK: torch.Tensor, w_EKN: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out_SN = x_SK.new_empty(x_SK.shape[0], w_EKN.shape[2])
        for x_nK, w_KN, out_nN in zip(x_SK.split(counts), w_EKN, out_SN.split(counts), strict=True):
            torch.mm(x_nK, w_KN, out=out_nN)
        ctx.save_for_backward(x_SK, w_EKN)
        ctx.counts = counts
        return out_SN

    @staticmethod
    def backward(ctx, grad_SN: torch.Tensor):
        x_SK, w_EKN = ctx.saved_tensors
        grad_SN = grad_SN.contiguous()
        grad_x_SK = torch.empty_like(x_SK) if ctx.needs_input_grad[0] else None
        grad_w_EKN = torch.empty_like(w_EKN) if ctx.needs_input_grad[1] else None
        grad_x_slices = grad_x_SK.split(ctx.counts) if grad_x_SK is not None else [None] * len(ctx.counts)
        slices = zip(x_SK.split(ctx.counts), grad_SN.split(ctx.counts), grad_x_slices, strict=True)
        for e, (x_nK, grad_nN, grad_x_nK) in enumerate(slices):
            if grad_x_nK is not None:
                torch.mm(grad_nN, w_EKN[e].t(), out=grad_x_nK)
            if grad_w_EKN is not None:
                torch.mm(x_nK.t(), grad_nN, out=grad_w_EKN[e])
        return grad_x_SK, grad_w_EKN, None


def grouped_swiglu(
    x_SD: torch.Tensor,
    w1_EDF: torch.Tensor,
    w2_EFD: torch.Tensor,
    w3_EDF: torch.Tensor,
    counts_E: torch.Tensor,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """SwiGLU expert MLPs on expert-sorted tokens: (silu(x w1) * x w3) w2, per expert."""
    h_SF = F.silu(grouped_mm(x_SD, w1_EDF, counts_E, use_grouped_mm))
    h_SF = h_SF * grouped_mm(x_SD, w3_EDF, counts_E, use_grouped_mm)
    return grouped_mm(h_SF, w2_EFD, counts_E, use_grouped_mm)
