"""Group token rows by expert and back (TEMPORARY: reference only until the Triton kernels land)."""

import torch
from torch import Tensor


def moe_permute_reference(
    x_TD: Tensor, expert_ids_TK: Tensor, num_experts: int, align: int = 1
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (x_ND, slots_TK, group_ends_E).

    Rows of expert e occupy [group_ends[e-1], group_ends[e]) (group starts padded up to a multiple of
    `align`), in token order within an expert; slots[t, k] is the row holding (t, k). N is the static
    bound T*K + E*(align-1) when align > 1 (padding rows are zero), else exactly T*K.
    """
    T, K = expert_ids_TK.shape
    flat = expert_ids_TK.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    rank_in_expert = torch.arange(T * K, device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    slots = torch.empty_like(flat)
    slots[order] = starts[flat[order]] + rank_in_expert
    N = T * K + num_experts * (align - 1) if align > 1 else T * K
    x_ND = x_TD.new_zeros(N, x_TD.shape[1])
    x_ND[slots] = x_TD.repeat_interleave(K, dim=0)
    return x_ND, slots.view(T, K), ends.to(torch.int32)


def moe_unpermute_reference(y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """out[t] = sum_k weights[t, k] * y[slots[t, k]] (slots < 0 contribute nothing), fp32 sum, y's dtype."""
    valid = slots_TK >= 0
    rows = y_ND[slots_TK.clamp(min=0)].float()  # [T, K, D]
    w = torch.where(valid, weights_TK.float(), 0.0)
    return (rows * w[..., None]).sum(1).to(y_ND.dtype)


moe_permute = moe_permute_reference
moe_unpermute = moe_unpermute_reference
