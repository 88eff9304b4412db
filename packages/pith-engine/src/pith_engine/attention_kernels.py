"""What both attention paths (pith_engine.attention, and ring_attention per block) compute with, over
explicit positions (key j visible to query i when pos_j <= pos_i, and pos_i - pos_j < W with a sliding
window W; with document ids, within a document only): the fp32 reference, the specification, and
compiled flex_attention returning the lse.
"""

import functools

import torch
from torch import Tensor


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, pos_q_BS: Tensor, pos_k_BS: Tensor, *, scale: float,
    window: int | None = None, sinks_H: Tensor | None = None, docs: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """In fp32 (fp64 for fp64 inputs) -> (out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] of the
    masked scores, sinks excluded). A query that sees no key gets out 0, lse -inf. docs: (query, key)
    document ids."""
    Hq, Hk = q.shape[2], k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = (t.to(compute).transpose(1, 2) for t in (q, k, v))
    kf, vf = (t.repeat_interleave(Hq // Hk, dim=1) for t in (kf, vf))
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    visible = band_visible(pos_q_BS[:, None, :, None] - pos_k_BS[:, None, None, :], window)
    if docs is not None:
        visible = visible & (docs[0][:, None, :, None] == docs[1][:, None, None, :])
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    denom = lse if sinks_H is None else torch.logaddexp(lse, sinks_H.to(compute)[None, :, None])
    probs = torch.exp(scores - denom.nan_to_num(neginf=0.0)[..., None])
    out = (probs @ vf).transpose(1, 2).to(q.dtype)
    return out, lse


def flex_fits(q: Tensor, v: Tensor) -> bool:
    # flex's Triton kernels need head dims >= 16 (tl.dot); smaller ones are toy models
    return q.is_cuda and min(q.shape[-1], v.shape[-1]) >= 16


def band_visible(dist: Tensor, window: int | None) -> Tensor:
    return (dist >= 0) & (dist < window) if window is not None else dist >= 0


@functools.cache
def compiled_create_block_mask():
    # compiled, the test fuses into the per-tile reduction (eager: [B, Sq, Sk] index tensors); new
    # tensors in the mask_mod's closure do not recompile
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


_FP32_BLOCKS = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")


@functools.cache
def _compiled_flex_attention():
    # imported on first use: flex_attention's import costs ~half of torch's own
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_attention_lse(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float) -> tuple[Tensor, Tensor]:
    """-> (out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] fp32)."""
    from torch.nn.attention.flex_attention import AuxRequest  # here: slow to import, CUDA-only

    out_BHSD, aux = _compiled_flex_attention()(
        *(t.transpose(1, 2) for t in (q, k, v)),
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
        # fp32 tiles at flex's default block sizes overflow shared memory for head dims > 128 (MLA's
        # 192): 32-row blocks fit every head dim here; bf16 keeps the tuned defaults.
        kernel_options=dict.fromkeys(_FP32_BLOCKS, 32) if q.dtype == torch.float32 else None,
    )
    return out_BHSD.transpose(1, 2), aux.lse
