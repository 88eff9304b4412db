"""Fused lm_head + cross-entropy (TEMPORARY: reference only until the chunked kernel lands)."""

import torch.nn.functional as F
from torch import Tensor


def linear_cross_entropy_reference(
    h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """cross_entropy(h @ w.T, labels) in fp32; "mean" over non-ignored tokens, or "sum"."""
    logits = h_TD.float() @ w_VD.float().T
    return F.cross_entropy(logits, labels_T, ignore_index=ignore_index, reduction=reduction)


linear_cross_entropy = linear_cross_entropy_reference
