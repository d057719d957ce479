"""Grouped SwiGLU experts over tokens sorted by expert: every expert's matmuls run on its
contiguous group of rows.

`torch._grouped_mm` runs each matmul for all groups in one kernel on CUDA (bf16, 16-byte
aligned rows). Elsewhere (CPU) one autograd Function loops over the experts and runs each
expert's whole MLP, forward and backward, on its slice of rows: the same per-expert matmuls as
PyTorch's CPU `_grouped_mm` kernel, with the elementwise work done on slices still in cache and
only the two pre-activations saved for the backward. Both paths compute per group
(silu(x_e w1[e]) * x_e w3[e]) w2[e], so the numerics match up to kernel rounding.
"""

import torch
import torch.nn.functional as F


def grouped_mm_supported(x_SK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    """True where `torch._grouped_mm` has a fast kernel: CUDA, bf16, rows aligned to 16 bytes."""
    aligned = all(n * x_SK.element_size() % 16 == 0 for n in (w_EKN.shape[1], w_EKN.shape[2]))
    return x_SK.is_cuda and x_SK.dtype == w_EKN.dtype == torch.bfloat16 and aligned


def grouped_swiglu(
    x_SD: torch.Tensor,
    w1_EDF: torch.Tensor,
    w2_EFD: torch.Tensor,
    w3_EDF: torch.Tensor,
    counts_E: torch.Tensor,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """SwiGLU expert MLPs on expert-sorted tokens (counts_E rows each, in expert order):
    (silu(x w1) * x w3) w2, per expert.

    use_grouped_mm: None picks `torch._grouped_mm` where `grouped_mm_supported`; True forces it
    (PyTorch also has a CPU kernel, used by the tests); False forces the per-expert loop.
    """
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x_SD, w1_EDF)
    if not use_grouped_mm:
        return _SliceLoopSwiGLU.apply(x_SD, w1_EDF, w2_EFD, w3_EDF, counts_E.tolist())
    offsets_E = counts_E.cumsum(0).to(torch.int32)
    h_SF = F.silu(torch._grouped_mm(x_SD, w1_EDF, offs=offsets_E)) * torch._grouped_mm(x_SD, w3_EDF, offs=offsets_E)
    return torch._grouped_mm(h_SF, w2_EFD, offs=offsets_E)


class _SliceLoopSwiGLU(torch.autograd.Function):
    """One expert at a time over its contiguous slice of rows, matmuls written straight into the
    outputs and gradient buffers. Saves only the two pre-activations; the backward recomputes
    silu from them. Experts with zero rows get a zero weight gradient, so every rank reduces
    the same set of tensors."""

    @staticmethod
    def forward(ctx, x_SD, w1_EDF, w2_EFD, w3_EDF, counts: list[int]) -> torch.Tensor:
        num_rows, hidden_dim = x_SD.shape[0], w1_EDF.shape[2]
        a_SF, b_SF = x_SD.new_empty(2, num_rows, hidden_dim)  # x w1 (gate), x w3 (up)
        y_SD = x_SD.new_empty(num_rows, w2_EFD.shape[2])
        slices = zip(x_SD.split(counts), a_SF.split(counts), b_SF.split(counts), y_SD.split(counts), strict=True)
        for e, (x_nD, a_nF, b_nF, y_nD) in enumerate(slices):
            torch.mm(x_nD, w1_EDF[e], out=a_nF)
            torch.mm(x_nD, w3_EDF[e], out=b_nF)
            torch.mm(F.silu(a_nF) * b_nF, w2_EFD[e], out=y_nD)
        ctx.save_for_backward(x_SD, a_SF, b_SF, w1_EDF, w2_EFD, w3_EDF)
        ctx.counts = counts
        return y_SD

    @staticmethod
    def backward(ctx, grad_y_SD: torch.Tensor):
        x_SD, a_SF, b_SF, w1_EDF, w2_EFD, w3_EDF = ctx.saved_tensors
        counts = ctx.counts
        grad_w1_EDF, grad_w2_EFD, grad_w3_EDF = (torch.empty_like(w) for w in (w1_EDF, w2_EFD, w3_EDF))
        grad_x_SD = torch.empty_like(x_SD) if ctx.needs_input_grad[0] else None
        grad_x_slices = grad_x_SD.split(counts) if grad_x_SD is not None else [None] * len(counts)
        grad_y_slices = grad_y_SD.contiguous().split(counts)
        slices = zip(x_SD.split(counts), a_SF.split(counts), b_SF.split(counts), grad_y_slices, grad_x_slices, strict=True)
        for e, (x_nD, a_nF, b_nF, grad_y_nD, grad_x_nD) in enumerate(slices):
            silu_nF = F.silu(a_nF)
            grad_h_nF = grad_y_nD @ w2_EFD[e].t()
            grad_a_nF = torch.ops.aten.silu_backward(grad_h_nF * b_nF, a_nF)
            grad_b_nF = grad_h_nF * silu_nF
            torch.mm((silu_nF * b_nF).t(), grad_y_nD, out=grad_w2_EFD[e])
            torch.mm(x_nD.t(), grad_a_nF, out=grad_w1_EDF[e])
            torch.mm(x_nD.t(), grad_b_nF, out=grad_w3_EDF[e])
            if grad_x_nD is not None:
                torch.mm(grad_a_nF, w1_EDF[e].t(), out=grad_x_nD)
                grad_x_nD.addmm_(grad_b_nF, w3_EDF[e].t())
        return grad_x_SD, grad_w1_EDF, grad_w2_EFD, grad_w3_EDF, None
