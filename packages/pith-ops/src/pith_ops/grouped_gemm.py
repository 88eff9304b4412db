"""Grouped GEMM over contiguous per-expert row segments: y[rows of e] = x[rows of e] @ w[e], by
torch's grouped matmul where it applies (faster: pith-ops README), else Triton kernels.

Shape legend: N grouped rows, I input features, O output features, E experts (groups).
"""

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops import _common
from pith_ops._common import FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, check, use_triton

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): H100-sized tiles; small ones for the interpreter.
TILES = (32, 32, 32, 1, 1) if INTERPRET else (128, 128, 64, 8, 3)


@triton.jit
def _group_of_tile(ends_ptr, tile, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    """-> (group, first row, end row) of row tile `tile`, each group cut into BLOCK_M tiles."""
    e = tl.arange(0, E_P2)
    end = tl.load(ends_ptr + e, mask=e < E, other=0)
    start = tl.load(ends_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    tiles = tl.where(e < E, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, 0)
    group = tl.sum((cum <= tile).to(tl.int32), 0)
    here = e == group
    row0 = tl.sum(tl.where(here, start + (tile - (cum - tiles)) * BLOCK_M, 0), 0)
    return group, row0, tl.sum(tl.where(here, end, 0), 0)


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, ends_ptr, E, I, O,
    s_xn, s_xi, s_we, s_wi, s_wo, s_yn, s_yo,
    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    group, row0, row_end = _group_of_tile(ends_ptr, tl.program_id(0), E, BLOCK_M, E_P2)
    if group >= E:  # the grid has room for the worst case
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < row_end
    x_p = x_ptr + rows.to(tl.int64)[:, None] * s_xn + ks[None, :] * s_xi
    w_p = w_ptr + group.to(tl.int64) * s_we + ks[:, None] * s_wi + cols[None, :] * s_wo
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = ks + k0 < I
        x = tl.load(x_p, mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_p, mask=k_ok[:, None] & (cols[None, :] < O), other=0)
        acc = tl.dot(x, w, acc)
        x_p += BLOCK_K * s_xi
        w_p += BLOCK_K * s_wi
    y_p = y_ptr + rows.to(tl.int64)[:, None] * s_yn + cols[None, :] * s_yo
    tl.store(y_p, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < O))


@triton.jit
def _grouped_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, ends_ptr, I, O,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dw[e] = x[rows of e].T @ dy[rows of e]; an empty group gets zeros."""
    e = tl.program_id(1)
    n_tiles = tl.cdiv(O, BLOCK_N)
    i_s = (tl.program_id(0) // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_s = (tl.program_id(0) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    rs = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        r = (r0 + rs).to(tl.int64)
        r_ok = r < end
        xt = tl.load(x_ptr + r[None, :] * I + i_s[:, None], mask=r_ok[None, :] & (i_s[:, None] < I), other=0)
        dy = tl.load(dy_ptr + r[:, None] * O + o_s[None, :], mask=r_ok[:, None] & (o_s[None, :] < O), other=0)
        acc = tl.dot(xt, dy, acc)
    dw_p = dw_ptr + e.to(tl.int64) * I * O + i_s[:, None] * O + o_s[None, :]
    tl.store(dw_p, acc.to(dw_ptr.dtype.element_ty), mask=(i_s[:, None] < I) & (o_s[None, :] < O))


@triton.jit
def _zero_tail_kernel(y_ptr, ends_ptr, E, N, O, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    last = tl.load(ends_ptr + E - 1)
    if tl.program_id(0) * ROWS + ROWS <= last:  # nearly every program: nothing past the end here
        return
    tail = (rows >= last) & (rows < N)
    for c0 in range(0, O, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        zero = tl.zeros([ROWS, BLOCK_N], dtype=y_ptr.dtype.element_ty)
        tl.store(
            y_ptr + rows.to(tl.int64)[:, None] * O + cols[None, :],
            zero,
            mask=tail[:, None] & (cols[None, :] < O),
        )


def _zero_tail(y_NO: Tensor, ends: Tensor) -> Tensor:
    N, O = y_NO.shape
    _zero_tail_kernel[(triton.cdiv(N, 64),)](y_NO, ends, ends.shape[0], N, O, ROWS=64, BLOCK_N=128)
    return y_NO


def _torch_path(x: Tensor, *sizes: int) -> bool:
    # CUTLASS: bf16 on CUDA, 16-byte strides (feature sizes a multiple of 8).
    return (
        _common.USE_TORCH_GROUPED_MM
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and all(s % 8 == 0 for s in sizes)
    )


@torch.library.custom_op("pith::grouped_gemm", mutates_args=())
def _grouped_gemm_op(x_NI: Tensor, w_EIO: Tensor, ends: Tensor) -> Tensor:
    """y = grouped x @ w[e]; w may be a transposed view (dX's)."""
    N, E, O = x_NI.shape[0], w_EIO.shape[0], w_EIO.shape[2]
    if N * O * w_EIO.shape[1] == 0:  # empty sums
        return x_NI.new_zeros(N, O)
    if _torch_path(x_NI, *w_EIO.shape[1:]):
        y = torch._grouped_mm(x_NI, w_EIO, offs=ends)
    else:
        y = x_NI.new_empty(N, O)
        bm, bn, bk, warps, stages = TILES
        # Each of at most min(E, N) non-empty groups adds at most one partial tile.
        grid = (triton.cdiv(N, bm) + min(E, N), triton.cdiv(O, bn))
        _grouped_mm_kernel[grid](
            x_NI, w_EIO, y, ends, E, w_EIO.shape[1], O, *x_NI.stride(), *w_EIO.stride(), *y.stride(),
            E_P2=triton.next_power_of_2(E), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return _zero_tail(y, ends)


@_grouped_gemm_op.register_fake
def _(x_NI, w_EIO, ends):
    return x_NI.new_empty(x_NI.shape[0], w_EIO.shape[2])


@torch.library.custom_op("pith::grouped_gemm_wgrad", mutates_args=())
def _wgrad_op(x_NI: Tensor, dy_NO: Tensor, group_ends_E: Tensor, E: int) -> Tensor:
    N, I = x_NI.shape
    O = dy_NO.shape[1]
    if N * I * O == 0:
        return x_NI.new_zeros(E, I, O)
    if _torch_path(x_NI, I, O):
        # Hopper CUTLASS writes zeros for empty groups (pytorch/pytorch#172439: not so on Blackwell).
        return torch._grouped_mm(x_NI.t(), dy_NO, offs=group_ends_E)
    dw = x_NI.new_empty(E, I, O)
    bm, bn, bk, warps, stages = TILES
    _grouped_wgrad_kernel[(triton.cdiv(I, bm) * triton.cdiv(O, bn), E)](
        x_NI, dy_NO, dw, group_ends_E, I, O,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dw


@_wgrad_op.register_fake
def _(x_NI, dy_NO, group_ends_E, E):
    return x_NI.new_empty(E, x_NI.shape[1], dy_NO.shape[1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy_NO):
    x_NI, w_EIO, ends = ctx.saved_tensors
    dx, wgrad = grouped_gemm_backward(x_NI, w_EIO, ends, dy_NO, ctx.needs_input_grad[0])
    return dx, wgrad() if ctx.needs_input_grad[1] else None, None


def grouped_gemm_backward(
    x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor, dy_NO: Tensor, need_dx: bool = True
) -> tuple[Tensor | None, Callable[[], Tensor]]:
    """grouped_gemm's backward in two halves (the weight gradient run later): -> (dx_NI or None, a
    closure computing dw_EIO), bit for bit a plain backward's."""
    dy_NO = dy_NO.contiguous()
    if not use_triton(x_NI):
        x, w = x_NI.detach().requires_grad_(need_dx), w_EIO.detach().requires_grad_()
        with torch.enable_grad():
            y_NO = grouped_gemm_reference(x, w, group_ends_E)
        dx = torch.autograd.grad(y_NO, x, dy_NO, retain_graph=True)[0] if need_dx else None
        return dx, lambda: torch.autograd.grad(y_NO, w, dy_NO)[0]
    ends, E = group_ends_E.to(torch.int32), w_EIO.shape[0]
    dx = _grouped_gemm_op(dy_NO, w_EIO.transpose(1, 2), ends) if need_dx else None
    return dx, lambda: _wgrad_op(x_NI, dy_NO, ends, E)


_grouped_gemm_op.register_autograd(_backward, setup_context=_setup)


def grouped_gemm(x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor) -> Tensor:
    """y_NO with y[group_ends[e-1]:group_ends[e]] = x[...] @ w[e] and rows past group_ends[-1] zero.
    group_ends_E (non-decreasing, last <= N) is trusted: checking it would need a host sync."""
    check("x_NI", x_NI, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    check("w_EIO", w_EIO, ndim=3, dtypes=(x_NI.dtype,), device=x_NI.device, contiguous=True)
    check("group_ends_E", group_ends_E, ndim=1, dtypes=INDEX_DTYPES, device=x_NI.device)
    if w_EIO.shape[1] != x_NI.shape[1]:
        raise ValueError(
            f"w_EIO: expected input size {x_NI.shape[1]} (x_NI's columns), got shape {tuple(w_EIO.shape)}"
        )
    if group_ends_E.shape[0] != w_EIO.shape[0]:
        raise ValueError(
            f"group_ends_E: expected {w_EIO.shape[0]} ends (one per expert), got {group_ends_E.shape[0]}"
        )
    if not use_triton(x_NI):
        return grouped_gemm_reference(x_NI, w_EIO, group_ends_E)
    return _grouped_gemm_op(x_NI, w_EIO, group_ends_E.to(torch.int32))


def grouped_gemm_reference(x_NI: Tensor, w_EIO: Tensor, group_ends_E: Tensor) -> Tensor:
    """y[rows of group e] = x[rows of group e] @ w[e], rows past the last end 0; fp32 accumulation
    (float64 inputs: float64)."""
    acc = torch.promote_types(x_NI.dtype, torch.float32)
    y = x_NI.new_zeros(x_NI.shape[0], w_EIO.shape[2])
    start = 0
    for e, end in enumerate(group_ends_E.tolist()):
        y[start:end] = (x_NI[start:end].to(acc) @ w_EIO[e].to(acc)).to(y.dtype)
        start = end
    return y
