"""Grouped GEMM over per-expert row segments (TEMPORARY: reference only until the kernel lands)."""

from torch import Tensor


def grouped_gemm_reference(x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor) -> Tensor:
    """y[rows of group e] = x[rows of group e] @ w[e]; rows past the last end give 0. fp32 accumulate."""
    y = x_NI.new_zeros(x_NI.shape[0], w_EIO.shape[2])
    start = 0
    for e, end in enumerate(group_ends_E.tolist()):
        y[start:end] = (x_NI[start:end].float() @ w_EIO[e].float()).to(y.dtype)
        start = end
    return y


grouped_gemm = grouped_gemm_reference
