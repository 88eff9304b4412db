"""Fused lm_head + cross-entropy: loss(h @ w.T, labels) without the full logits (the chunks, the
FP8 GEMMs and their measurements: pith-ops README).

Shape legend: T tokens, C tokens in one chunk, D model dim, V vocabulary.

The forward computes the gradients (over a chunk's logits) and keeps them; the backward scales them.
dw accumulates in w's dtype (fp32 inside each matmul; an fp32 accumulator: ~3.7 GB more traffic a
chunk, estimated). Labels outside [0, V) but ignore_index are caught for eager CPU tensors only; on
CUDA such a row's loss is its lse.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, check, use_triton
from pith_ops.fp8_linear import _mm
from pith_ops.fp8_quant import (
    FP8,
    _cast,
    _interpreted_cast,
    _pow2_scale,
    cols_from_rows,
    cols_from_rows_reference,
    dequantize_cols,
    dequantize_rows,
    quantize_rows,
    quantize_rows_reference,
    quantize_weight_reference,
)

CHUNK_LOGITS = 2**29  # logits per chunk: 1 GiB in bf16; C = 3533 rows at V = 151,936
BLOCK_V = 256 if INTERPRET else 4096
# dh's FP8 GEMM with fast accumulation: 1539 against 1926 us a chunk, error 2.9e-3 against 1.6e-3, a
# tenth of the e4m3 gradient rows' own (H200).
FAST = True
# Vocabulary rows of each FP8 weight-gradient GEMM (their transposed gradient rows: 64 MiB at 8,192 tokens).
FP8_WGRAD_ROWS = 8192
# Parts of the tokens (whole chunks) whose e4m3 gradient rows are buffered ([T / parts, V]) for the FP8
# weight gradient: 2 halve the buffer (2.3 -> 1.2 GiB at 16,384 x 151,936) for one more pass over dw.
FP8_WGRAD_PARTS = 2


def fp8_chunk_rows(V: int) -> int:
    """Tokens per chunk under FP8: a power of two (2048 at V = 151,936: faster GEMMs than 3520, README)."""
    return max(16, 1 << (max(1, CHUNK_LOGITS // max(V, 1)).bit_length() - 1))


def fp8_wgrad_part_ends(T: int, V: int) -> list[int]:
    """The token ends of the FP8 weight gradient's parts."""
    C, per_part = fp8_chunk_rows(V), -(-T // FP8_WGRAD_PARTS)
    P = max(1, -(-per_part // C)) * C
    return [*range(P, T, P), T] if T else []


@triton.jit
def _ce_rows_kernel(
    logits_CV_ptr, labels_ptr, loss_ptr, scale_ptr, g8_ptr, g8_scale_ptr, V, ignore_index,
    WRITE_GRAD: tl.constexpr, WRITE_G8: tl.constexpr, BLOCK_V: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    """Per row: loss = lse - logit[label] (0 if ignored); WRITE_GRAD: row <- g = (softmax - onehot) *
    scale; WRITE_G8: g8, g8 scale <- quantize_rows(g in fp32)."""
    row = tl.program_id(0)
    base = logits_CV_ptr + row.to(tl.int64) * V
    label = tl.load(labels_ptr + row).to(tl.int32)
    cols = tl.arange(0, BLOCK_V)
    # Online log-sum-exp per lane, merged at the end; lanes start at the lowest finite fp32, not -inf,
    # so m - m_new is never inf - inf.
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
    if WRITE_GRAD or WRITE_G8:
        scale = tl.where(valid, tl.load(scale_ptr), 0.0)
        if WRITE_G8:
            # The row's largest |g| (quantize_rows' scale, same fp32 expressions) is at the label or the
            # largest other logit: every lane's max but the label lane's, whose other values are read
            # again (tracking it in the loop above cost a compare and a select per logit).
            lane = tl.where(in_vocab, label % BLOCK_V, -1)
            others = tl.max(tl.where(cols == lane, -3.4e38, m), 0)
            at = lane + tl.arange(0, STEPS).to(tl.int64) * BLOCK_V
            keep = (at >= 0) & (at < V) & (at != label)
            lane_values = tl.load(base + at, mask=keep, other=-3.4e38).to(tl.float32)
            others = tl.maximum(others, tl.max(lane_values, 0))
            at_label = tl.where(in_vocab, tl.abs((tl.exp(target - lse) - 1.0) * scale), 0.0)
            g8_scale, inv = _pow2_scale(tl.maximum(tl.exp(others - lse) * scale, at_label))
            tl.store(g8_scale_ptr + row, g8_scale)
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - (c == label).to(tl.float32)) * scale
            if WRITE_GRAD:
                tl.store(base + c, g.to(logits_CV_ptr.dtype.element_ty), mask=c < V)
            if WRITE_G8:  # from the fp32 g, not the bf16 stored: rounding twice can land elsewhere
                g8 = g8_ptr + row.to(tl.int64) * V + c
                tl.store(g8, _cast(g, inv).to(g8_ptr.dtype.element_ty), mask=c < V)


def _ce_rows(logits_CV, labels_C, loss_C, scale, ignore_index, write_grad, g8=None):
    """The kernel, or its math in torch (CPU, float64). g8: (g8_CV, g8_scale_C) buffers, or None."""
    if use_triton(logits_CV) and logits_CV.dtype != torch.float64:  # without g8 loss_C stands in, unread
        _ce_rows_kernel[(logits_CV.shape[0],)](
            logits_CV, labels_C, loss_C, scale, *(g8 or (loss_C, loss_C)), logits_CV.shape[1], ignore_index,
            WRITE_GRAD=write_grad, WRITE_G8=g8 is not None, BLOCK_V=BLOCK_V, num_warps=1 if INTERPRET else 8,
            STEPS=triton.next_power_of_2(triton.cdiv(logits_CV.shape[1], BLOCK_V)),
        )  # fmt: skip
        return
    x = logits_CV.to(torch.promote_types(logits_CV.dtype, torch.float32))
    valid = labels_C != ignore_index
    onehot = F.one_hot(torch.where(valid, labels_C, 0).long(), x.shape[1]) * valid[:, None]
    lse = x.logsumexp(1)
    loss_C.copy_(torch.where(valid, lse - (x * onehot).sum(1), 0.0))
    if write_grad or g8 is not None:
        g = (torch.exp(x - lse[:, None]) - onehot) * torch.where(valid, scale, 0.0)[:, None]
        if write_grad:
            logits_CV.copy_(g)
        if g8 is not None:
            for out, t in zip(g8, quantize_rows_reference(g, g8[0].dtype)):
                out.copy_(t)


def _fp8_wgrad(
    g8_TV: Tensor, g8_scale_T: Tensor, h8_TD: Tensor, h8_scale_T: Tensor, dw_VD: Tensor, add: bool
) -> None:
    """dw_VD (+)= g.T @ h from the e4m3 rows of g and h, as fp8_linear's wgrad, FP8_WGRAD_ROWS rows a GEMM."""
    h8c_DT, h8c_scale_D = cols_from_rows(h8_TD, h8_scale_T)
    for v0 in range(0, g8_TV.shape[1], FP8_WGRAD_ROWS):
        g8c_VT, g8c_scale_V = cols_from_rows(g8_TV[:, v0 : v0 + FP8_WGRAD_ROWS], g8_scale_T)
        # fp32 promotion: it contracts over the tokens
        rows = dw_VD[v0 : v0 + FP8_WGRAD_ROWS]
        out = rows if rows.dtype == torch.bfloat16 and not add else None
        y = _mm(g8c_VT, g8c_scale_V[0], h8c_DT, h8c_scale_D[0], False, out)
        if out is None:
            rows.add_(y) if add else rows.copy_(y)


def _grad_scale(labels_T: Tensor, ignore_index: int, reduction: str) -> tuple[Tensor, Tensor]:
    """-> (n_valid, the gradient scale), on the device (no host sync)."""
    n_valid = (labels_T != ignore_index).sum(dtype=torch.float32)
    return n_valid, 1.0 / n_valid.clamp(min=1.0) if reduction == "mean" else torch.ones_like(n_valid)


@torch.library.custom_op("pith::linear_cross_entropy", mutates_args=())
def _lce_op(
    h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int, reduction: str, grad_h: bool,
    grad_w: bool, w8_VD: Tensor | None = None, w8_scale_V: Tensor | None = None, w8t_DV: Tensor | None = None,
    w8t_scale_D: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """w8_*: quantize_weight(w_VD) for the FP8 GEMMs, or None."""
    T, V = h_TD.shape[0], w_VD.shape[0]
    n_valid, scale = _grad_scale(labels_T, ignore_index, reduction)
    loss_T = torch.empty(T, dtype=torch.float32, device=h_TD.device)
    dh = torch.empty_like(h_TD) if grad_h else h_TD.new_empty(0)
    fp8 = w8_VD is not None
    dw = w_VD.new_empty(0)
    if grad_w:  # contiguous, whatever w_VD's strides
        dw = (torch.empty if fp8 and T else torch.zeros)(w_VD.shape, dtype=w_VD.dtype, device=w_VD.device)
    C = max(1, CHUNK_LOGITS // max(V, 1))
    if fp8:
        h8_TD, h8_scale_T = quantize_rows(h_TD)
        C = fp8_chunk_rows(V)
        g8_dtype = torch.float32 if INTERPRET else FP8  # see _interpreted_cast
        ends = fp8_wgrad_part_ends(T, V)
        P = ends[0] if ends else C
        if grad_w:  # a part's gradient rows (dh alone: a chunk's)
            g8_PV, g8_scale_P = h_TD.new_empty(min(P, T), V, dtype=g8_dtype), loss_T.new_empty(min(P, T))
    for c0 in range(0, T, C):
        h_CD, rows = h_TD[c0 : c0 + C], slice(c0, c0 + C)
        if fp8:
            logits_CV = _mm(h8_TD[rows], h8_scale_T[rows], w8_VD, w8_scale_V).to(h_TD.dtype)
            g8, end = None, min(c0 + C, T)
            if grad_w:
                p0 = c0 - c0 % P  # this part's first token
                g8 = g8_PV[c0 - p0 : end - p0], g8_scale_P[c0 - p0 : end - p0]
            elif grad_h:
                g8 = h_TD.new_empty(logits_CV.shape, dtype=g8_dtype), loss_T.new_empty(logits_CV.shape[0])
            _ce_rows(logits_CV, labels_T[rows], loss_T[rows], scale, ignore_index, False, g8)
            if grad_h:
                dh[rows] = _mm(*(_interpreted_cast(*g8) if INTERPRET else g8), w8t_DV, w8t_scale_D, FAST)
            if grad_w and end in ends:  # the part's last chunk: its dw GEMMs
                part = g8_PV[: end - p0], g8_scale_P[: end - p0]
                part = _interpreted_cast(*part) if INTERPRET else part
                _fp8_wgrad(*part, h8_TD[p0:end], h8_scale_T[p0:end], dw, add=p0 > 0)
            continue
        logits_CV = h_CD @ w_VD.T
        _ce_rows(logits_CV, labels_T[rows], loss_T[rows], scale, ignore_index, grad_h or grad_w)
        if grad_h:
            torch.mm(logits_CV, w_VD, out=dh[rows])
        if grad_w:
            dw.addmm_(logits_CV.T, h_CD)
    loss = loss_T.sum()
    return loss / n_valid if reduction == "mean" else loss, dh, dw


@_lce_op.register_fake
def _(h_TD, w_VD, labels_T, ignore_index, reduction, grad_h, grad_w, *w8):
    return (
        h_TD.new_empty((), dtype=torch.float32),
        torch.empty_like(h_TD) if grad_h else h_TD.new_empty(0),
        w_VD.new_empty(w_VD.shape) if grad_w else w_VD.new_empty(0),
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
        *[None] * 9,
    )


_lce_op.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(
    h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int = -100, reduction: str = "mean",
    w8: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """cross_entropy(h @ w.T, labels) as an fp32 scalar: "mean" over non-ignored tokens, or "sum".
    w8: quantize_weight(w_VD) of w's current values, for FP8 GEMMs (on CUDA T, D and V multiples of
    16); the gradient still reaches w through w_VD."""
    check("h_TD", h_TD, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    # With w8 w_VD's values are not read (pith_ops.stand_in).
    check("w_VD", w_VD, ndim=2, dtypes=(h_TD.dtype,), device=h_TD.device, contiguous=w8 is None)
    check("labels_T", labels_T, ndim=1, dtypes=INDEX_DTYPES, device=h_TD.device, contiguous=True)
    V, D = w_VD.shape
    if h_TD.shape[1] != D:
        raise ValueError(f"w_VD: expected {h_TD.shape[1]} columns (h_TD's model dim), got shape {(V, D)}")
    if labels_T.shape[0] != h_TD.shape[0]:
        raise ValueError(
            f"labels_T: expected {h_TD.shape[0]} labels (one per row of h_TD), got {labels_T.shape[0]}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f'reduction: expected "mean" or "sum", got {reduction!r}')
    if w8 is not None:
        if len(w8) != 4:
            raise ValueError(f"w8: expected the 4 tensors of quantize_weight(w_VD), got {len(w8)}")
        for i, (t, shape) in enumerate(zip(w8, ((V, D), (V,), (D, V), (D,)))):
            check(f"w8[{i}]", t, dtypes=((FP8, torch.float32)[i % 2],), device=h_TD.device)
            if tuple(t.shape) != shape:
                raise ValueError(f"w8[{i}]: expected shape {shape} (quantize_weight(w_VD)), got {t.shape}")
        if h_TD.is_cuda and (D % 16 or V % 16 or h_TD.shape[0] % 16):
            T = h_TD.shape[0]
            raise ValueError(
                f"w8 on CUDA: tokens, D and V must be multiples of 16 (FP8 GEMMs), got {T}, {D}, {V}"
            )
    if not labels_T.is_cuda and not torch.compiler.is_compiling():
        bad = (labels_T != ignore_index) & ((labels_T < 0) | (labels_T >= V))
        if bad.any():
            raise ValueError(f"labels_T: expected ids in [0, {V}) or {ignore_index}, got {labels_T[bad][0]}")
    if not use_triton(h_TD) and w8 is None:
        return linear_cross_entropy_reference(h_TD, w_VD, labels_T, ignore_index, reduction)
    grad = torch.is_grad_enabled()
    grads = (grad and h_TD.requires_grad, grad and w_VD.requires_grad)
    return _lce_op(h_TD, w_VD, labels_T, ignore_index, reduction, *grads, *(w8 or (None,) * 4))[0]


def linear_cross_entropy_reference(
    h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """cross_entropy(h @ w.T, labels) in fp32 (float64 inputs: float64)."""
    acc = torch.promote_types(h_TD.dtype, torch.float32)
    logits = h_TD.to(acc) @ w_VD.to(acc).T
    return F.cross_entropy(logits, labels_T, ignore_index=ignore_index, reduction=reduction)


def dequantized(h_TD: Tensor, w_VD: Tensor) -> tuple[Tensor, Tensor]:
    """The FP8 operands h8, w8 in float64."""
    q, scale_V, _, _ = quantize_weight_reference(w_VD[None])
    return dequantize_rows(*quantize_rows_reference(h_TD)), dequantize_rows(q[0], scale_V[0])


def linear_cross_entropy_fp8_reference(
    h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int = -100, reduction: str = "mean", dloss=1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """The FP8 path's specification in float64 -> (loss, dh_TD, dw_VD) for an upstream gradient dloss:
    x = h8 @ w8.T (dequantized), loss = cross_entropy(x, labels); g = d loss / d x (0 when no token is
    kept); dh = dloss * g8 @ w8, g8 = quantize_rows_reference(g in fp32); dw = dloss * g8c @ h8c.T, g8
    and h8 requantised by columns over each part of the tokens. Not modelled: the op's bf16 logits and
    GEMM outputs, and their sum over the parts."""
    h8_TD, w8_VD = dequantized(h_TD, w_VD)
    g_TV = h8_TD @ w8_VD.T  # the logits, overwritten with their gradient
    loss_T = g_TV.new_empty(g_TV.shape[0])
    n_valid, scale = _grad_scale(labels_T, ignore_index, reduction)
    _ce_rows(g_TV, labels_T, loss_T, scale.double(), ignore_index, True)
    g8 = quantize_rows_reference(g_TV.float())
    loss = loss_T.sum() / n_valid if reduction == "mean" else loss_T.sum()
    parts = torch.tensor(fp8_wgrad_part_ends(*g_TV.shape), dtype=torch.int32, device=h_TD.device)
    cols = lambda t8: dequantize_cols(*cols_from_rows_reference(*t8, parts), parts)
    dw = dloss * cols(g8) @ cols(quantize_rows_reference(h_TD)).T
    return loss, dloss * dequantize_rows(*g8) @ w8_VD, dw
