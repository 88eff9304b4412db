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

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, check, use_triton
from pith_ops.grouped_gemm import _group_of_tile

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Tiles: both kernels hold a whole tile in registers, so every element of x is read once from memory.
# Rows: BLOCK_M x next_pow2(K) with ROWS_ELEMS elements, while K <= ROWS_MAX_K; longer rows loop twice
# over BLOCK_K chunks (the second read mostly from cache). Cols: a strip of up to COLS_MAX_M rows x
# BLOCK_K columns, COLS_ELEMS elements (at least 16 columns: 32-byte row pieces of bf16 x; at 16 warps
# 128 registers a thread, 80 bytes spilled, compiled for sm_90 by Triton 3.9). The
# interpreter (CPU tests) gets small tiles so that both paths of each kernel run.
ROWS_ELEMS, ROWS_MAX_K, ROWS_WARPS = (256, 128, 1) if INTERPRET else (8192, 8192, 8)
COLS_ELEMS, COLS_MAX_M, COLS_WARPS = (512, 16, 1) if INTERPRET else (32768, 2048, 16)


@triton.jit
def _pow2_scale(amax):
    """-> (scale, 1 / scale): the smallest power of two with amax / scale <= 448, from amax's bits.
    amax = m * 2^(e - 127) with m in [1, 2); 448 = 1.75 * 2^8, so scale = 2^(e - 127 - 8 + [m > 1.75])."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 1), 253)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _inverse_pow2(scale):
    """1 / scale for a scale of _pow2_scale, from its bits (exact; fp32 division may not be)."""
    return ((254 - (scale.to(tl.int32, bitcast=True) >> 23)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _cast(x, inv):
    return tl.minimum(tl.maximum(x * inv, -448.0), 448.0)


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr
):  # fmt: skip
    """BLOCK_M rows; ONE_PASS (BLOCK_K >= K): one load of the rows, else an amax loop and a cast loop."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    base = rows.to(tl.int64)[:, None] * K
    if ONE_PASS:
        m = (rows[:, None] < M) & (ks[None, :] < K)
        x = tl.load(x_ptr + base + ks[None, :], mask=m, other=0.0).to(tl.float32)
        scale, inv = _pow2_scale(tl.max(tl.abs(x), 1))
        tl.store(s_ptr + rows, scale, mask=rows < M)
        tl.store(q_ptr + base + ks[None, :], _cast(x, inv[:, None]).to(q_ptr.dtype.element_ty), mask=m)
    else:
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
            q = _cast(x, inv[:, None]).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + base + k0 + ks[None, :], q, mask=m)


@triton.jit
def _quant_cols_tile(
    x_ptr, q_ptr, s_ptr, queue_ptr, ends_ptr, G, M, K, s_qb, s_qk, strip, tile, b, slot,
    G_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FINISH: tl.constexpr,
):  # fmt: skip
    """Columns strip * BLOCK_K.. of row tile `tile` (each group cut into BLOCK_M-row tiles) of batch entry
    b. A group of at most BLOCK_M rows is one tile, read once: the column scales, then q[b, cols, rows] =
    x / scale. The tiles of a longer group max their scales into s atomically (the max of the tiles'
    scales is the group's: pow2_scale is monotonic; s starts at 2^-126, the scale of 0) and queue their
    slot; the FINISH launch reads them again and writes q."""
    g, row0, row_end = _group_of_tile(ends_ptr, tile, G, BLOCK_M, G_P2)
    start = tl.load(ends_ptr + tl.maximum(g - 1, 0), mask=g > 0, other=0)
    whole = row_end - start <= BLOCK_M
    b = b.to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = strip * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows[:, None] < row_end) & (cols[None, :] < K)
    x = tl.load(x_ptr + b * M * K + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=m, other=0.0)
    x = x.to(tl.float32)
    s_p = s_ptr + (b * G + g) * K + cols
    if FINISH:
        inv = _inverse_pow2(tl.load(s_p, mask=cols < K, other=1.0))
        q_end = row_end
    else:
        scale, inv = _pow2_scale(tl.max(tl.abs(x), 0))
        if whole:
            tl.store(s_p, scale, mask=cols < K)
        else:
            tl.atomic_max(s_p, scale, mask=cols < K)
            tl.store(queue_ptr + 1 + tl.atomic_add(queue_ptr, 1), slot)
        q_end = tl.where(whole, row_end, row0)  # a longer group's quotients wait for its scale (FINISH)
    q = tl.trans(_cast(x, inv[None, :]).to(q_ptr.dtype.element_ty))
    q_p = q_ptr + b * s_qb + cols.to(tl.int64)[:, None] * s_qk
    if (row0 % 16 == 0) & (q_end % 16 == 0):  # the FP8 GEMMs' groups; written as multiples of 16, the
        r16 = row0 // 16 * 16 + tl.arange(0, BLOCK_M)  # compiler stores 16 bytes at a time, not 1
        tl.store(q_p + r16[None, :], q, mask=(r16[None, :] < q_end // 16 * 16) & (cols[:, None] < K))
    else:
        tl.store(q_p + rows[None, :], q, mask=(rows[None, :] < q_end) & (cols[:, None] < K))


@triton.jit
def _quant_cols_kernel(
    x_ptr, q_ptr, s_ptr, queue_ptr, ends_ptr, G, B, M, K, s_qb, s_qk,
    G_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FINISH: tl.constexpr,
):  # fmt: skip
    """Persistent programs over the slots (strip fastest, then batch entry, then row tile: neighbouring
    programs read neighbouring pieces of the same rows): all the tiles of the groups, or (FINISH) the
    queued ones. The default tile's program takes 128 registers a thread (sm_90), one program per SM:
    a grid with a program per possible tile of the worst-case grouping (a third of them idle at the
    bench's) would spend more on starting idle programs than a tile's work."""
    strips = tl.cdiv(K, BLOCK_K)
    if FINISH:
        n = tl.load(queue_ptr)
    else:  # the row tiles of all groups
        e = tl.arange(0, G_P2)
        end = tl.load(ends_ptr + e, mask=e < G, other=0)
        begin = tl.load(ends_ptr + e - 1, mask=(e > 0) & (e < G), other=0)
        n = tl.sum(tl.where(e < G, (end - begin + BLOCK_M - 1) // BLOCK_M, 0), 0) * strips * B
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        slot = tl.load(queue_ptr + 1 + i) if FINISH else i
        _quant_cols_tile(
            x_ptr, q_ptr, s_ptr, queue_ptr, ends_ptr, G, M, K, s_qb, s_qk,
            slot % strips, slot // strips // B, slot // strips % B, slot, G_P2, BLOCK_M, BLOCK_K, FINISH,
        )  # fmt: skip


def pow2_scale(amax: Tensor) -> Tensor:
    """The scale of _pow2_scale, in torch (the references use it)."""
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
        _launch_rows(x_MK, q, scale, *_rows_tile(K))
    return q, scale


def _rows_tile(K: int) -> tuple[int, int, bool, int]:
    """-> (BLOCK_M, BLOCK_K, ONE_PASS, num_warps) of _quant_rows_kernel for rows of K elements."""
    k_p2 = triton.next_power_of_2(max(K, 1))
    if k_p2 <= ROWS_MAX_K:
        return max(1, ROWS_ELEMS // k_p2), k_p2, True, ROWS_WARPS
    bk = min(1024, ROWS_MAX_K)
    return max(1, ROWS_ELEMS // bk), bk, False, ROWS_WARPS


def _launch_rows(x_MK, q_MK, scale_M, bm: int, bk: int, one_pass: bool, warps: int) -> None:
    M, K = x_MK.shape
    _quant_rows_kernel[(triton.cdiv(M, bm),)](
        x_MK, q_MK, scale_M, M, K, BLOCK_M=bm, BLOCK_K=bk, ONE_PASS=one_pass, num_warps=warps
    )


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
        scale = torch.full((B, G, K), 2.0**-126, dtype=torch.float32, device=x3.device)
        if M * K and G:
            _launch_cols(x3, group_ends_G.to(torch.int32).contiguous(), q, scale, *_cols_tile(M, K))
    return (q, scale) if x_BMK.ndim == 3 else (q[0], scale[0])


def _cols_tile(M: int, K: int) -> tuple[int, int, int]:
    """-> (BLOCK_M, BLOCK_K, num_warps) of _quant_cols_kernel for x [B, M, K]: a strip of (up to
    COLS_MAX_M) rows x BLOCK_K columns, COLS_ELEMS elements held in registers (64 per thread)."""
    bm = min(COLS_MAX_M, triton.next_power_of_2(max(M, 1)))
    bk = min(triton.next_power_of_2(max(K, 1)), max(16, COLS_ELEMS // bm))
    return bm, bk, max(1, min(COLS_WARPS, bm * bk // 2048))


def _launch_cols(x_BMK, ends_G, q_BKM, scale_BGK, bm: int, bk: int, warps: int, per_sm: int = 1) -> None:
    """scale_BGK must hold 2^-126 (the scale of an empty group, and where the atomic maxima start).
    per_sm: programs per SM (persistent: as many as fit at once, or the last ones run alone)."""
    B, M, K = x_BMK.shape
    G = ends_G.shape[0]
    slots = (triton.cdiv(M, bm) + min(G, M)) * triton.cdiv(K, bk) * B  # the most tiles G groups cut into
    long = bm < M  # only then can a group be longer than a tile
    queue = torch.empty(1 + slots if long else 1, dtype=torch.int32, device=x_BMK.device)
    if long:
        queue[:1].zero_()
    grid = (min(slots, _programs(x_BMK.device) * per_sm),)
    for finish in (False, True)[: 1 + long]:
        _quant_cols_kernel[grid](
            x_BMK, q_BKM, scale_BGK, queue, ends_G, G, B, M, K, q_BKM.stride(0), q_BKM.stride(1),
            G_P2=triton.next_power_of_2(G), BLOCK_M=bm, BLOCK_K=bk, FINISH=finish, num_warps=warps,
        )  # fmt: skip


@functools.cache
def _programs(device: torch.device) -> int:
    """Streaming multiprocessors (a few programs under the interpreter)."""
    return 3 if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count


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
