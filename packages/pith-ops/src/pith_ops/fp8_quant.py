"""FP8 (e4m3) quantisation with power-of-two scales, in the three forms the FP8 GEMMs take (recipe
and measurements: pith-ops README).

Shape legend: M rows, K columns, G row groups (ending at group_ends), B batch entries (a stacked
weight's experts), R and C a weight's rows and columns.

scale = the smallest power of two with amax / scale <= 448 (e4m3's largest finite value); an
all-zero row gets 2^-126. Values past 448 * scale (a weight grown since its scale) saturate.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, check, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class FP8Weight(NamedTuple):
    """quantize_weight's four outputs (the GEMMs' w8) and the amax of the next update's scale."""

    q: Tensor  # [B, R, C] or [R, C], e4m3
    scale_rows: Tensor  # [B, R] or [R]
    qt: Tensor  # [B, C, R] or [C, R], e4m3, 16-byte row strides (empty_cols)
    scale_cols: Tensor  # [B, C] or [C]
    amax: Tensor  # [B] (a 2-D weight: [1]), fp32


class FP8Rows(NamedTuple):
    """Rows in e4m3 (quantize_rows) and x carrying their gradient: the rows, or a stand-in once the
    e4m3 rows have moved (moe_permute, an EP exchange)."""

    x: Tensor  # [M, K]
    q: Tensor  # [M, K] e4m3
    scale: Tensor  # [M] fp32


def fp8_rows(x_MK: Tensor) -> FP8Rows:
    """x with quantize_rows(x), outside autograd."""
    return FP8Rows(x_MK, *quantize_rows(x_MK.detach()))


# Rows kernel: BLOCK_M rows a program, BLOCK_K columns a step (82% of copy, H200, [131072, 2048] bf16).
ROWS_TILE = (4, 128) if INTERPRET else (16, 1024)
# Columns kernel, [BLOCK_M, BLOCK_K] e4m3 tiles, 4 warps: 64 x 128 transposes [132992, 2048] at 88% of
# copy (H200), as fast as 128 x 128; 64-wide tiles and 8 warps slower.
COLS_TILE = (16, 32) if INTERPRET else (64, 128)


@triton.jit
def _pow2_scale(amax):
    """-> (scale, 1 / scale) from amax's bits: amax = m * 2^(e - 127) with m in [1, 2), 448 = 1.75 * 2^8,
    so scale = 2^(e - 127 - 8 + [m > 1.75])."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 1), 253)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _cast(x, inv):
    return tl.minimum(tl.maximum(x * inv, -448.0), 448.0)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    base = rows.to(tl.int64)[:, None] * K
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        m = (rows[:, None] < M) & (k0 + ks[None, :] < K)
        x = tl.load(x_ptr + base + k0 + ks[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    scale, inv = _pow2_scale(amax)
    tl.store(s_ptr + rows, scale, mask=rows < M)
    for k0 in range(0, K, BLOCK_K):
        m = (rows[:, None] < M) & (k0 + ks[None, :] < K)
        x = tl.load(x_ptr + base + k0 + ks[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(q_ptr + base + k0 + ks[None, :], _cast(x, inv[:, None]).to(q_ptr.dtype.element_ty), mask=m)


@triton.jit
def _group_scale_kernel(s_ptr, ends_ptr, scale_ptr, f_ptr, M, K, G, BLOCK: tl.constexpr):
    """Group g: S = its largest row scale, scale[g, :] = S, f = s / S for its rows (0 past the last)."""
    g = tl.program_id(0)
    end = tl.load(ends_ptr + g)
    start = tl.minimum(tl.load(ends_ptr + g - 1, mask=g > 0, other=0), end)
    offs = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], 2.0**-126, tl.float32)
    for r0 in range(start, end, BLOCK):
        top = tl.maximum(top, tl.load(s_ptr + r0 + offs, mask=r0 + offs < end, other=0.0))
    S = tl.max(top, 0)
    for r0 in range(start, end, BLOCK):
        m = r0 + offs < end
        tl.store(f_ptr + r0 + offs, tl.div_rn(tl.load(s_ptr + r0 + offs, mask=m, other=0.0), S), mask=m)
    for k0 in range(0, K, BLOCK):
        tl.store(scale_ptr + g * K + k0 + offs, tl.zeros([BLOCK], tl.float32) + S, mask=k0 + offs < K)
    if g == G - 1:
        for r0 in range(end, M, BLOCK):
            tl.store(f_ptr + r0 + offs, tl.zeros([BLOCK], tl.float32), mask=r0 + offs < M)


@triton.jit
def _cols_kernel(
    q_ptr, f_ptr, out_ptr, M, K, s_qb, s_qm, s_ob, s_out, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    """A tile of batch entry program_id(2), rescaled by f (None: 1), stored transposed. Masks by M and K,
    whose alignment the compiler knows: by the last group end loads did not vectorise (9% of copy, H200)."""
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(q_ptr + b * s_qb + rows.to(tl.int64)[:, None] * s_qm + cols[None, :], mask=m, other=0.0)
    f = 1.0 if f_ptr is None else tl.load(f_ptr + rows, mask=rows < M, other=0.0)[:, None]
    out = out_ptr + b * s_ob + cols.to(tl.int64)[:, None] * s_out + rows[None, :]
    tl.store(out, tl.trans(_cast(x.to(tl.float32), f)).to(out_ptr.dtype.element_ty), mask=tl.trans(m))


@triton.jit
def _entry_amax(amax_ptr, offs, mask, RC, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """-> (b, amax[b]) of a block's flat offsets into [B, R, C]. ALIGNED (R * C a multiple of BLOCK): one
    load a block (per element: AdamW with FP8 copies 24.4-31.9 ms a step, not 21.8; H200)."""
    if ALIGNED:
        b = (tl.program_id(0).to(tl.int64) * BLOCK) // RC
        amax = tl.load(amax_ptr + b)
    else:
        b = offs // RC
        amax = tl.load(amax_ptr + b, mask=mask, other=0.0)
    return b, amax


@triton.jit
def _weight_rows_kernel(w_ptr, q_ptr, amax_ptr, N, RC, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """q = w / scale(amax[b]) over [B, R, C] flat."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    _, inv = _pow2_scale(_entry_amax(amax_ptr, offs, mask, RC, ALIGNED, BLOCK)[1])
    q = _cast(tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32), inv)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weight_scales_kernel(amax_ptr, s_rows_ptr, s_cols_ptr, gate_ptr, R, C, BLOCK: tl.constexpr):
    """Entry b's scale repeated along its R rows and C columns, unless gate is not finite."""
    b = tl.program_id(0).to(tl.int64)
    scale, _ = _pow2_scale(tl.load(amax_ptr + b))
    gate = 0.0 if gate_ptr is None else tl.load(gate_ptr)
    if gate - gate == 0:
        offs = tl.arange(0, BLOCK)
        for i in range(0, tl.maximum(R, C), BLOCK):
            tl.store(s_rows_ptr + b * R + i + offs, tl.zeros([BLOCK], tl.float32) + scale, mask=i + offs < R)
            tl.store(s_cols_ptr + b * C + i + offs, tl.zeros([BLOCK], tl.float32) + scale, mask=i + offs < C)


def pow2_scale(amax: Tensor) -> Tensor:
    bits = amax.float().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return (e.clamp(1, 253) << 23).view(torch.float32)


def _quantize(x: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(out_dtype)


def _interpreted_cast(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Triton's interpreter drops the carry when e4m3 rounding crosses a binade (127.85 -> 64, not 128):
    interpreted kernels write fp32 quotients and torch casts them."""
    return q.to(FP8), scale


def empty_cols(K: int, M: int, dtype: torch.dtype = FP8, device=None, batch: tuple = ()) -> Tensor:
    """[*batch, K, M], rows padded in storage to 16 elements: an FP8 GEMM operand for any M."""
    return torch.empty(*batch, K, (M + 15) // 16 * 16, dtype=dtype, device=device)[..., :M]


def quantize_rows(x_MK: Tensor, out_dtype: torch.dtype = FP8) -> tuple[Tensor, Tensor]:
    """-> q_MK (x / scale in out_dtype), scale_M (fp32): quantize_rows_reference."""
    check("x_MK", x_MK, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    if not use_triton(x_MK):
        return quantize_rows_reference(x_MK, out_dtype)
    if INTERPRET and out_dtype == FP8:  # see _interpreted_cast
        return _interpreted_cast(*quantize_rows(x_MK, torch.float32))
    M, K = x_MK.shape
    q, scale = torch.empty(M, K, dtype=out_dtype, device=x_MK.device), x_MK.new_empty(M, dtype=torch.float32)
    if M:
        bm, bk = ROWS_TILE
        bk = min(bk, triton.next_power_of_2(max(K, 1)))
        _quant_rows_kernel[(triton.cdiv(M, bm),)](x_MK, q, scale, M, K, BLOCK_M=bm, BLOCK_K=bk, num_warps=4)
    return q, scale


def cols_from_rows(
    q_MK: Tensor, scale_M: Tensor, group_ends_G: Tensor | None = None, out_dtype: torch.dtype = FP8
) -> tuple[Tensor, Tensor]:
    """-> qc_KM (empty_cols), scale_GK: q_MK * scale_M requantised with one scale per row group,
    transposed (cols_from_rows_reference); q_MK may be a slice of columns. group_ends_G: non-decreasing,
    last <= M; None: one group."""
    check("q_MK", q_MK, ndim=2, dtypes=(FP8, torch.float32))
    M, K = q_MK.shape
    if K > 1 and q_MK.stride(1) != 1:
        raise ValueError(f"q_MK: expected contiguous rows (column stride 1), got strides {q_MK.stride()}")
    check("scale_M", scale_M, ndim=1, dtypes=(torch.float32,), device=q_MK.device, contiguous=True)
    if scale_M.shape[0] != M:
        raise ValueError(f"scale_M: expected one scale per row of q_MK ({M}), got {scale_M.shape[0]}")
    if group_ends_G is None:
        group_ends_G = torch.full((1,), M, dtype=torch.int32, device=q_MK.device)
    check("group_ends_G", group_ends_G, ndim=1, dtypes=INDEX_DTYPES, device=q_MK.device)
    G = group_ends_G.shape[0]
    out = empty_cols(K, M, out_dtype, q_MK.device)
    if not use_triton(q_MK):
        ref, scale = cols_from_rows_reference(q_MK, scale_M, group_ends_G, out_dtype)
        return out.copy_(ref), scale
    if INTERPRET and out_dtype == FP8:  # see _interpreted_cast
        q32, scale = cols_from_rows(q_MK, scale_M, group_ends_G, torch.float32)
        return out.copy_(q32), scale
    ends = group_ends_G.to(torch.int32).contiguous()
    scale, f = q_MK.new_empty(G, K, dtype=torch.float32), torch.empty_like(scale_M)
    if G:  # a block holds a group's rows (8192 at most: a dense layer's 16384 in 2)
        block = 64 if INTERPRET else min(8192, max(1024, triton.next_power_of_2(triton.cdiv(M, G))))
        warps = 4 if block <= 1024 else 8
        _group_scale_kernel[(G,)](scale_M, ends, scale, f, M, K, G, BLOCK=block, num_warps=warps)
    bm, bk = COLS_TILE
    if M and K and G:
        _cols_kernel[(triton.cdiv(M, bm), triton.cdiv(K, bk), 1)](
            q_MK, f, out, M, K, 0, q_MK.stride(0), 0, out.stride(0), BLOCK_M=bm, BLOCK_K=bk, num_warps=4
        )
    return out, scale


def quantize_weight(w_BRC: Tensor, amax_B: Tensor | None = None, out_dtype: torch.dtype = FP8):
    """-> (q_BRC, scale_BR, qT_BCR, scale_BC) as quantize_weight_reference's, qT by empty_cols; a 2-D w
    is a batch of one. amax_B (fp32 [B]): the scale's amax (adamw_'s, before its update); None: w's."""
    check("w_BRC", w_BRC, dtypes=FLOAT_DTYPES, contiguous=True)
    if w_BRC.ndim not in (2, 3):
        raise ValueError(f"w_BRC: expected 2 or 3 dimensions, got shape {tuple(w_BRC.shape)}")
    w3 = w_BRC if w_BRC.ndim == 3 else w_BRC[None]
    B, R, C = w3.shape
    if amax_B is None:
        amax_B = weight_amax(w3)
    check("amax_B", amax_B, ndim=1, dtypes=(torch.float32,), device=w3.device, contiguous=True)
    if amax_B.shape[0] != B:
        raise ValueError(f"amax_B: expected one amax per batch entry ({B}), got {amax_B.shape[0]}")
    if not use_triton(w3):
        out = quantize_weight_reference(w3, amax_B, out_dtype)
    elif INTERPRET and out_dtype == FP8:  # see _interpreted_cast
        q, s_rows, qt, s_cols = quantize_weight(w3, amax_B, torch.float32)
        qt8 = empty_cols(C, R, FP8, w3.device, (B,))
        out = q.to(FP8), s_rows, qt8.copy_(qt), s_cols
    else:
        q = torch.empty(B, R, C, dtype=out_dtype, device=w3.device)
        qt = empty_cols(C, R, out_dtype, w3.device, (B,))
        s_rows, s_cols = w3.new_empty(B, R, dtype=torch.float32), w3.new_empty(B, C, dtype=torch.float32)
        if w3.numel():
            _weight_rows_kernel[(triton.cdiv(w3.numel(), 4096),)](
                w3, q, amax_B, w3.numel(), R * C, ALIGNED=R * C % 4096 == 0, BLOCK=4096
            )
        weight_copies(FP8Weight(q, s_rows, qt, s_cols, amax_B))
        out = q, s_rows, qt, s_cols
    return out if w_BRC.ndim == 3 else tuple(t[0] for t in out)


def weight_copies(copies: FP8Weight, gate: Tensor | None = None) -> None:
    """Writes copies' scales and transposed copy from q and amax (the scales stay where gate, adamw_'s
    clip scale, is not finite). Apart from q's kernel: README (Weights from the optimizer)."""
    q3, qt3 = (copies.q, copies.qt) if copies.q.ndim == 3 else (copies.q[None], copies.qt[None])
    B, R, C = q3.shape
    if B:
        block = 16 if INTERPRET else 1024
        _weight_scales_kernel[(B,)](
            copies.amax, copies.scale_rows, copies.scale_cols, gate, R, C, BLOCK=block, num_warps=4
        )
    bm, bk = COLS_TILE
    if q3.numel():
        grid = (triton.cdiv(R, bm), triton.cdiv(C, bk), B)
        strides = q3.stride(0), C, qt3.stride(0), qt3.stride(1)
        _cols_kernel[grid](q3, None, qt3, R, C, *strides, BLOCK_M=bm, BLOCK_K=bk, num_warps=4)


def copies_of_quantized(q_BRC: Tensor, amax_B: Tensor, into: FP8Weight | None = None) -> FP8Weight:
    """quantize_weight(w, amax_B)'s copies, bit for bit, from q alone (a weight gathered in e4m3). into:
    an earlier call's copies on q's storage, rewritten in place."""
    q3 = q_BRC if q_BRC.ndim == 3 else q_BRC[None]
    B, R, C = q3.shape
    if into is not None:
        qt, s_rows, s_cols = (
            t if q_BRC.ndim == 3 else t[None] for t in (into.qt, into.scale_rows, into.scale_cols)
        )
    else:  # quantize_weight's layouts (the reference's qT is a view of q)
        qt = empty_cols(C, R, q3.dtype, q3.device, (B,)) if use_triton(q3) else q3.mT
        s_rows, s_cols = (q3.new_empty(B, n, dtype=torch.float32) for n in (R, C))
    if use_triton(q3):
        weight_copies(FP8Weight(q3, s_rows, qt, s_cols, amax_B))
    else:
        scale_B1 = pow2_scale(amax_B)[:, None]
        for t in (s_rows, s_cols):
            with torch.autograd._unsafe_preserve_version_counter(t):  # a backward may have saved it
                t.copy_(scale_B1.expand_as(t))
    out = FP8Weight(q3, s_rows, qt, s_cols, amax_B)
    return out if q_BRC.ndim == 3 else FP8Weight(*(t[0] for t in out[:4]), amax_B)


def weight_amax(w_BRC: Tensor) -> Tensor:
    """amax_B (fp32) of a 3-D weight's entries, or [1] of a 2-D one."""
    w3 = w_BRC.detach().flatten(1) if w_BRC.ndim == 3 else w_BRC.detach().reshape(1, -1)
    if not w3.numel():
        return w3.new_zeros(w3.shape[0], dtype=torch.float32)
    return torch.linalg.vector_norm(w3, float("inf"), dim=1).float()


def quantize_rows_reference(x_MK: Tensor, out_dtype: torch.dtype = FP8) -> tuple[Tensor, Tensor]:
    """scale_M = pow2_scale(amax of each row), q = clamp(x / scale, +-448) in out_dtype."""
    scale = pow2_scale(x_MK.float().abs().amax(1) if x_MK.shape[1] else x_MK.new_zeros(x_MK.shape[0]))
    return _quantize(x_MK, scale[:, None], out_dtype), scale


def cols_from_rows_reference(
    q_MK: Tensor, scale_M: Tensor, group_ends_G: Tensor, out_dtype: torch.dtype = FP8
) -> tuple[Tensor, Tensor]:
    """Per row group g: S = the largest scale_M of its rows (2^-126 for none), qc[:, rows of g] =
    clamp(q * scale_M / S, +-448) in out_dtype, transposed; scale[g, :] = S. Rows past the end: 0."""
    M, K = q_MK.shape
    qc = torch.zeros(K, M, dtype=out_dtype, device=q_MK.device)
    scale = torch.full((group_ends_G.shape[0], K), 2.0**-126, device=q_MK.device)
    start = 0
    for g, end in enumerate(group_ends_G.tolist()):
        if end > start:
            scale[g] = scale_M[start:end].max()
            x = q_MK[start:end].double() * scale_M[start:end, None].double()
            qc[:, start:end] = _quantize(x, scale[g, 0], out_dtype).T
        start = max(start, end)
    return qc, scale


def quantize_weight_reference(w_BRC: Tensor, amax_B: Tensor | None = None, out_dtype: torch.dtype = FP8):
    """scale_B = pow2_scale(amax_B, default each entry's amax), q = clamp(w / scale, +-448), qT = q.mT,
    the scales repeated [B, R] and [B, C]."""
    B, R, C = w_BRC.shape
    amax = w_BRC.float().abs().flatten(1).amax(1) if amax_B is None and w_BRC.numel() else amax_B
    scale = pow2_scale(w_BRC.new_zeros(B) if amax is None else amax)
    q = _quantize(w_BRC, scale[:, None, None], out_dtype)
    return q, scale[:, None].expand(B, R).contiguous(), q.mT, scale[:, None].expand(B, C).contiguous()


def dequantize_rows(q_MK: Tensor, scale_M: Tensor) -> Tensor:
    """q * scale in float64 (exact)."""
    return q_MK.double() * scale_M.double()[:, None]


def dequantize_cols(qc_KM: Tensor, scale_GK: Tensor, group_ends_G: Tensor) -> Tensor:
    """The inverse of cols_from_rows in float64, still [K, M]."""
    ends = group_ends_G.long().cpu()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).clamp(min=0)
    scale_KM = scale_GK.double().T.repeat_interleave(sizes.to(scale_GK.device), dim=1)
    out = torch.zeros(qc_KM.shape, dtype=torch.float64, device=qc_KM.device)
    n = scale_KM.shape[1]
    out[:, :n] = qc_KM[:, :n].double() * scale_KM
    return out
