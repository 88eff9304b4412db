"""FP8 (e4m3) quantisation with power-of-two scales: along rows, or along columns with a transposed copy.

Shape legend: B batch (experts of a stacked weight; 1 otherwise), M rows, K columns, G row groups
(contiguous row segments ending at group_ends, as the grouped GEMM's experts; 1 otherwise).

A row-wise scaled GEMM multiplies a [M, K] operand whose every row has one scale (the amax over the
contracted K) by a column-major [K, N] operand whose every column has one. The backward GEMMs contract
over other axes, so an operand needs a second copy scaled along its columns and stored transposed:
- quantize_rows(x_MK) -> q_MK, scale_M: amax over each row;
- quantize_cols(x_BMK, group_ends_G) -> q_BKM (transposed), scale_BGK: amax over each column of each
  row group (the wgrad of a grouped GEMM contracts over one expert's rows).
scale = the smallest power of two with amax / scale <= 448 (e4m3's largest finite value), so
x / scale is exact in fp32, dequantisation (q * scale) is exact, and kernel and reference agree bit
for bit; an all-zero row gets scale 2^-126. The power of two costs at most one bit of range against
amax / 448 (DeepSeek-V3 and torchao round scales the same way).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, check, use_triton
from pith_ops.grouped_gemm import _group_of_tile

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Rows kernel: BLOCK_M rows per program, BLOCK_K columns per loop step (82% of copy bandwidth on an
# H200 at [131072, 2048] bf16). The column kernel's tile is autotuned per shape (both passes can rerun:
# an atomic max and a store of the same values); the interpreter (CPU tests) gets one small tile.
ROWS_TILE = (4, 128) if INTERPRET else (16, 1024)
_COLS_TILES = ((16, 32, 1),) if INTERPRET else ((64, 128, 4), (128, 64, 4), (128, 128, 8), (256, 64, 8))
_COLS_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_K": k}, num_warps=w) for m, k, w in _COLS_TILES]


@triton.jit
def _pow2_scale(amax):
    """-> (scale, 1 / scale): the smallest power of two with amax / scale <= 448, from amax's bits.
    amax = m * 2^(e - 127) with m in [1, 2); 448 = 1.75 * 2^8, so scale = 2^(e - 127 - 8 + [m > 1.75])."""
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


@triton.autotune(_COLS_CONFIGS, key=["M", "K", "G", "WRITE"])
@triton.jit
def _quant_cols_kernel(
    x_ptr, q_ptr, amax_ptr, ends_ptr, G, M, K, s_qb, s_qk,
    G_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, WRITE: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_K] tile of one row group of batch entry program_id(2). Pass 1 (not WRITE):
    atomic max of the tile's column amaxes into amax[b, g, :]. Pass 2: q[b, cols, rows] = x / scale."""
    g, row0, row_end = _group_of_tile(ends_ptr, tl.program_id(0), G, BLOCK_M, G_P2)
    if g >= G:  # the grid has room for the worst case; the spare programs leave at once
        return
    b = tl.program_id(2).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows[:, None] < row_end) & (cols[None, :] < K)
    x = tl.load(x_ptr + b * M * K + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=m, other=0.0)
    x = x.to(tl.float32)
    a_p = amax_ptr + (b * G + g) * K + cols
    if WRITE:
        _, inv = _pow2_scale(tl.load(a_p, mask=cols < K, other=0.0))
        q_p = q_ptr + b * s_qb + cols.to(tl.int64)[:, None] * s_qk + rows[None, :]
        tl.store(q_p, tl.trans(_cast(x, inv[None, :]).to(q_ptr.dtype.element_ty)), mask=tl.trans(m))
    else:
        tl.atomic_max(a_p, tl.max(tl.abs(x), 0), mask=cols < K)


def pow2_scale(amax: Tensor) -> Tensor:
    """The scale of _pow2_scale, in torch (the references and the column kernel's last step use it)."""
    bits = amax.float().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return (e.clamp(1, 253) << 23).view(torch.float32)


def _quantize(x: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(out_dtype)


def _interpreted_cast(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Triton's CPU interpreter drops the carry when e4m3 rounding crosses into the next binade (127.85
    -> 64, not 128); interpreted kernels write the exact fp32 quotients and torch casts them."""
    return q.to(FP8), scale


def quantize_rows(x_MK: Tensor, out_dtype: torch.dtype = FP8) -> tuple[Tensor, Tensor]:
    """-> q_MK (x / scale in out_dtype: e4m3; float32 lets CPU tests see the kernel's values before the
    cast, which Triton's interpreter rounds wrongly for some), scale_M (fp32, amax of each row)."""
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


def empty_cols(B: int, K: int, M: int, dtype: torch.dtype = FP8, device=None) -> Tensor:
    """quantize_cols' output q_BKM: rows of M padded in storage to a multiple of 16 elements, so the
    transposed copy is a valid FP8 GEMM operand (16-byte row strides) for any M."""
    return torch.empty(B, K, (M + 15) // 16 * 16, dtype=dtype, device=device)[..., :M]


def quantize_cols(
    x_BMK: Tensor, group_ends_G: Tensor | None = None, out_dtype: torch.dtype = FP8
) -> tuple[Tensor, Tensor]:
    """-> q_BKM (x transposed, / scale; laid out by empty_cols), scale_BGK (fp32, amax of each column
    over each row group; group_ends_G: int32 ends, non-decreasing, last <= M; None: one group of all
    M rows). Rows past the last end are not read, and their columns of q are left unwritten. A 2-D x
    is a batch of one."""
    check("x_BMK", x_BMK, dtypes=FLOAT_DTYPES, contiguous=True)
    if x_BMK.ndim not in (2, 3):
        raise ValueError(f"x_BMK: expected 2 or 3 dimensions, got shape {tuple(x_BMK.shape)}")
    x3 = x_BMK if x_BMK.ndim == 3 else x_BMK[None]
    B, M, K = x3.shape
    if group_ends_G is None:
        group_ends_G = torch.full((1,), M, dtype=torch.int32, device=x3.device)
    check("group_ends_G", group_ends_G, ndim=1, dtypes=INDEX_DTYPES, device=x3.device)
    q = empty_cols(B, K, M, out_dtype, x3.device)
    if not use_triton(x3):
        ref_q, scale = quantize_cols_reference(x3, group_ends_G, out_dtype)
        q.copy_(ref_q)
    elif INTERPRET and out_dtype == FP8:  # see _interpreted_cast
        q32, scale = quantize_cols(x3, group_ends_G, torch.float32)
        q.copy_(q32)  # torch's cast
    else:
        G = group_ends_G.shape[0]
        ends = group_ends_G.to(torch.int32).contiguous()
        amax = torch.zeros(B, G, K, dtype=torch.float32, device=x3.device)
        if M * K and G:
            for write in (False, True):
                grid = lambda meta: (
                    triton.cdiv(M, meta["BLOCK_M"]) + min(G, M),
                    triton.cdiv(K, meta["BLOCK_K"]),
                    B,
                )
                _quant_cols_kernel[grid](
                    x3, q, amax, ends, G, M, K, q.stride(0), q.stride(1),
                    G_P2=triton.next_power_of_2(G), WRITE=write,
                )  # fmt: skip
        scale = pow2_scale(amax)
    return (q, scale) if x_BMK.ndim == 3 else (q[0], scale[0])


def quantize_rows_reference(x_MK: Tensor, out_dtype: torch.dtype = FP8) -> tuple[Tensor, Tensor]:
    """scale_M = pow2_scale(amax of each row), q = clamp(x / scale, +-448) in out_dtype."""
    scale = pow2_scale(x_MK.float().abs().amax(1) if x_MK.shape[1] else x_MK.new_zeros(x_MK.shape[0]))
    return _quantize(x_MK, scale[:, None], out_dtype), scale


def quantize_cols_reference(x_BMK: Tensor, group_ends_G: Tensor, out_dtype: torch.dtype = FP8):
    """Per batch entry and row group g (rows group_ends[g-1]:group_ends[g]): scale[b, g, k] =
    pow2_scale(amax over the group's rows of column k), q[b, k, rows of g] = x[b, rows, k] / scale.
    Rows past the last end are zero in q."""
    B, M, K = x_BMK.shape
    q = torch.zeros(B, K, M, dtype=out_dtype, device=x_BMK.device)
    amax = x_BMK.new_zeros(B, group_ends_G.shape[0], K, dtype=torch.float32)
    start = 0
    for g, end in enumerate(group_ends_G.tolist()):
        if end > start:
            amax[:, g] = x_BMK[:, start:end].float().abs().amax(1)
            q[:, :, start:end] = _quantize(x_BMK[:, start:end], pow2_scale(amax[:, g])[:, None], out_dtype).mT
        start = max(start, end)
    return q, pow2_scale(amax)


def dequantize_rows(q_MK: Tensor, scale_M: Tensor) -> Tensor:
    """q * scale in float64 (exact: the scales are powers of two)."""
    return q_MK.double() * scale_M.double()[:, None]


def dequantize_cols(q_BKM: Tensor, scale_BGK: Tensor, group_ends_G: Tensor) -> Tensor:
    """The inverse of quantize_cols in float64, still transposed: [B, K, M]; rows past the last end 0."""
    ends = group_ends_G.long().cpu()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).clamp(min=0)
    scale_BKM = scale_BGK.double().transpose(1, 2).repeat_interleave(sizes.to(scale_BGK.device), dim=2)
    out = torch.zeros(q_BKM.shape, dtype=torch.float64, device=q_BKM.device)
    n = scale_BKM.shape[2]
    out[..., :n] = q_BKM[..., :n].double() * scale_BKM
    return out
