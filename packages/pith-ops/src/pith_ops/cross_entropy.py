"""Fused lm_head + cross-entropy: loss(h @ w.T, labels) without the full logits.

Shape legend: T tokens, C tokens in one chunk, D model dim, V vocabulary.

Full fp32 logits for 16,384 tokens x 151,936 words would take 10 GB. The forward walks the tokens in
chunks of ~2^29 / V: one torch matmul gives the chunk's logits (in h's dtype), a Triton kernel
computes each row's log-sum-exp and loss and overwrites the logits with d loss / d logits, and two
more matmuls turn that into the chunk's dh rows and its share of dw. Gradients are therefore
computed during the forward and kept for the backward, which only scales them by the incoming
gradient (the usual fused linear cross-entropy; three matmuls per chunk instead of one now and two
later, with no second pass over the vocabulary). dw accumulates across chunks in w's dtype with
addmm (fp32 inside each matmul, one rounding per chunk): an fp32 accumulator would add ~3.7 GB of
traffic per chunk, ~1.2 ms against ~10 ms of matmuls at the sizes above (estimated, not measured).
Labels outside [0, V) other than ignore_index are checked only for CPU tensors in eager mode (a
host sync on CUDA); on CUDA such a row reads no logit, so its loss is its log-sum-exp.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, check, use_triton

CHUNK_LOGITS = 2**29  # logits per chunk: 1 GiB in bf16; C = 3533 rows at V = 151,936
BLOCK_V = 256 if INTERPRET else 4096


@triton.jit
def _ce_rows_kernel(
    logits_CV_ptr, labels_ptr, loss_ptr, scale_ptr, V, ignore_index,
    WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Per row: loss = lse - logit[label] (0 if ignored); WRITE_GRAD: row <- (softmax - onehot) * scale."""
    row = tl.program_id(0)
    base = logits_CV_ptr + row.to(tl.int64) * V
    label = tl.load(labels_ptr + row).to(tl.int32)
    cols = tl.arange(0, BLOCK_V)
    # Online log-sum-exp kept per lane, merged once at the end.
    # Lanes start at the lowest finite fp32, not -inf, so m - m_new is never inf - inf.
    m = tl.full([BLOCK_V], -3.4e38, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    row_max = tl.max(m, 0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
    valid = label != ignore_index
    in_vocab = valid & (label >= 0) & (label < V)
    target = tl.load(base + label, mask=in_vocab, other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(scale_ptr), 0.0)
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - (c == label).to(tl.float32)) * scale
            tl.store(base + c, g.to(logits_CV_ptr.dtype.element_ty), mask=c < V)


@torch.library.custom_op("pith::linear_cross_entropy", mutates_args=())
def _lce_op(
    h_TD: Tensor,
    w_VD: Tensor,
    labels_T: Tensor,
    ignore_index: int,
    reduction: str,
    grad_h: bool,
    grad_w: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    T, V = h_TD.shape[0], w_VD.shape[0]
    valid = labels_T != ignore_index
    n_valid = valid.sum(dtype=torch.float32)
    # The gradient scale stays on the device: 1 / n_valid for the mean (no host sync to read n_valid).
    scale = 1.0 / n_valid.clamp(min=1.0) if reduction == "mean" else torch.ones((), device=h_TD.device)
    loss_T = torch.empty(T, dtype=torch.float32, device=h_TD.device)
    dh = torch.empty_like(h_TD) if grad_h else h_TD.new_empty(0)
    dw = torch.zeros_like(w_VD) if grad_w else w_VD.new_empty(0)
    write_grad = grad_h or grad_w
    C = max(1, CHUNK_LOGITS // max(V, 1))
    for c0 in range(0, T, C):
        h_CD = h_TD[c0 : c0 + C]
        logits_CV = h_CD @ w_VD.T
        _ce_rows_kernel[(h_CD.shape[0],)](
            logits_CV, labels_T[c0 : c0 + C], loss_T[c0 : c0 + C], scale, V, ignore_index,
            WRITE_GRAD=write_grad, BLOCK_V=BLOCK_V, num_warps=1 if INTERPRET else 8,
        )  # fmt: skip
        if grad_h:
            torch.mm(logits_CV, w_VD, out=dh[c0 : c0 + C])
        if grad_w:
            dw.addmm_(logits_CV.T, h_CD)
    loss = loss_T.sum()
    return loss / n_valid if reduction == "mean" else loss, dh, dw


@_lce_op.register_fake
def _(h_TD, w_VD, labels_T, ignore_index, reduction, grad_h, grad_w):
    return (
        h_TD.new_empty((), dtype=torch.float32),
        torch.empty_like(h_TD) if grad_h else h_TD.new_empty(0),
        torch.empty_like(w_VD) if grad_w else w_VD.new_empty(0),
    )


def _setup(ctx, inputs, output):
    _, dh, dw = output
    ctx.mark_non_differentiable(dh, dw)
    ctx.save_for_backward(dh, dw)
    ctx.grad_h, ctx.grad_w = inputs[5], inputs[6]


def _backward(ctx, dloss, _ddh, _ddw):
    dh, dw = ctx.saved_tensors
    return (
        dh * dloss.to(dh.dtype) if ctx.grad_h else None,
        dw * dloss.to(dw.dtype) if ctx.grad_w else None,
        None, None, None, None, None,
    )  # fmt: skip


_lce_op.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(
    h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """cross_entropy(h @ w.T, labels) as an fp32 scalar: "mean" over non-ignored tokens, or "sum"."""
    check("h_TD", h_TD, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    check("w_VD", w_VD, ndim=2, dtypes=(h_TD.dtype,), device=h_TD.device, contiguous=True)
    check("labels_T", labels_T, ndim=1, dtypes=INDEX_DTYPES, device=h_TD.device, contiguous=True)
    if w_VD.shape[1] != h_TD.shape[1]:
        raise ValueError(
            f"w_VD: expected {h_TD.shape[1]} columns (h_TD's model dim), got shape {tuple(w_VD.shape)}"
        )
    if labels_T.shape[0] != h_TD.shape[0]:
        raise ValueError(
            f"labels_T: expected {h_TD.shape[0]} labels (one per row of h_TD), got {labels_T.shape[0]}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f'reduction: expected "mean" or "sum", got {reduction!r}')
    if not labels_T.is_cuda and not torch.compiler.is_compiling():  # a data-dependent check: eager CPU only
        bad = (labels_T != ignore_index) & ((labels_T < 0) | (labels_T >= w_VD.shape[0]))
        if bad.any():
            raise ValueError(
                f"labels_T: expected ids in [0, {w_VD.shape[0]}) or {ignore_index}, got {labels_T[bad][0]}"
            )
    if not use_triton(h_TD):
        return linear_cross_entropy_reference(h_TD, w_VD, labels_T, ignore_index, reduction)
    grad = torch.is_grad_enabled()
    out = _lce_op(
        h_TD,
        w_VD,
        labels_T,
        ignore_index,
        reduction,
        grad and h_TD.requires_grad,
        grad and w_VD.requires_grad,
    )
    return out[0]


def linear_cross_entropy_reference(
    h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """cross_entropy(h @ w.T, labels) in fp32 (float64 inputs: float64); "mean" over kept tokens, or "sum"."""
    acc = torch.promote_types(h_TD.dtype, torch.float32)
    logits = h_TD.to(acc) @ w_VD.to(acc).T
    return F.cross_entropy(logits, labels_T, ignore_index=ignore_index, reduction=reduction)
