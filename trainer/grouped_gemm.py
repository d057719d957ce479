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
    # Every expert takes part, even with zero rows, so each weight gets a (zero) gradient
    # and data-parallel gradient reductions see the same set of tensors on every rank.
    # unbind, not w_EKN[e]: its backward stacks the E gradients once, where indexing would
    # add E zero-filled copies of the whole weight.
    slices = x_SK.split(counts_E.tolist())
    return torch.cat([x_e @ w_KN for x_e, w_KN in zip(slices, w_EKN.unbind(0), strict=True)])


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
