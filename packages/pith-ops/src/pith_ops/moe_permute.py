"""Group token rows by expert (moe_permute) and the weighted combine back (moe_unpermute), each
other's backward. How the launches overlap and what they measured: pith-ops README.

Shape legend: T tokens, K router top-k, D model dim, E experts, N grouped rows, C chunks of CT tokens
(CT * K <= CHUNK entries), R rows of a tile.

A negative expert id routes nowhere, so a caller can route a subset of the entries (EP's rows by
destination rank) with a static `rows`. Ids >= E and a too small `rows` are caught for eager CPU
tensors only. Two (t, k) entries may not share a row of moe_unpermute's y (moe_permute's slots never do).
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, check, eager_or_custom, use_triton
from pith_ops.fp8_quant import FP8, FP8Rows

# Experts per compare step of the chunk counts: a [128, 64] compare is 64 values a thread at 4 warps;
# the interpreter (CPU tests) pays per step, not per value.
EXPERT_TILE = 256 if INTERPRET else 64
# The per-expert scan takes [SCAN_CHUNKS, EXPERT_SCAN] a step: T=16384 at top-8 in one, 125 registers at
# 8 warps (sm_90; 8 or 16 experts spill). The interpreter pays per program (4096 experts in programs of
# 4: 35 s on CPU).
EXPERT_SCAN = 256 if INTERPRET else 4
SCAN_CHUNKS = 4 if INTERPRET else 1024
# Entries a chunk holds at most (the in-chunk rank is a [CHUNK, CHUNK] compare); also bounds top-k.
CHUNK = tl.constexpr(128)


@triton.jit
def _chunk_ids(ids_TK_ptr, c, T, K: tl.constexpr, CT: tl.constexpr):
    """-> (entries, ok, ids) of chunk c's CT * K entries in CHUNK lanes."""
    j = tl.arange(0, CHUNK)
    entries = c * CT * K + j
    ok = (j < CT * K) & (entries < T * K)
    return entries, ok, tl.load(ids_TK_ptr + entries, mask=ok, other=-1).to(tl.int32)


@triton.jit
def _chunk_histogram_kernel(
    ids_TK_ptr, counts_CE_ptr, arrivals_ptr, T, E, K: tl.constexpr, CT: tl.constexpr, ET: tl.constexpr
):
    """counts[c, e] = entries of expert e in chunk c; program 0 resets the scan's arrival counter.
    Compares, as tl.histogram costs O(bins) per value and wants a power-of-two constexpr bin count."""
    c = tl.program_id(0)
    if c == 0:
        tl.store(arrivals_ptr, 0)
    _, _, ids = _chunk_ids(ids_TK_ptr, c, T, K, CT)
    for e0 in range(0, E, ET):
        experts = e0 + tl.arange(0, ET)
        counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.store(counts_CE_ptr + c * E + experts, counts, mask=experts < E)


@triton.jit
def _histogram_scan_kernel(
    counts_CE_ptr, pre_CE_ptr, total_E_ptr, arrivals_ptr, starts_E_ptr, ends_E_ptr, C, E, align,
    CB: tl.constexpr, EB: tl.constexpr, E_P2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per expert (EB a program): pre[c, e] = entries of e in chunks < c; total[e] = all of them. The
    last program to finish turns the totals into group starts and ends (padded to `align`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    experts = tl.program_id(0) * EB + tl.arange(0, EB)
    e_ok = experts < E
    carry = tl.zeros([EB], dtype=tl.int32)
    for c0 in range(0, C, CB):
        chunks = c0 + tl.arange(0, CB)
        p = chunks[:, None] * E + experts[None, :]
        m = (chunks < C)[:, None] & e_ok[None, :]
        counts = tl.load(counts_CE_ptr + p, mask=m, other=0)
        tl.store(pre_CE_ptr + p, carry[None, :] + tl.cumsum(counts, 0) - counts, mask=m)
        carry += tl.sum(counts, 0)
    tl.store(total_E_ptr + experts, carry, mask=e_ok)
    tl.debug_barrier()  # the totals are written before the arrival (a release) counts
    if tl.atomic_add(arrivals_ptr, 1) == tl.num_programs(0) - 1:
        every = tl.arange(0, E_P2)
        # Written by programs on other SMs: read at L2 (.cg), past this SM's L1.
        total = tl.load(total_E_ptr + every, mask=every < E, other=0, cache_modifier=".cg")
        padded = (total + align - 1) // align * align
        ends = tl.cumsum(padded, 0)
        tl.store(ends_E_ptr + every, ends, mask=every < E)
        tl.store(starts_E_ptr + every, ends - padded, mask=every < E)


@triton.jit
def _store_rows(
    src_TD_ptr, slots_TK_ptr, w_TK_ptr, y_ND_ptr, out_ND_ptr, dw_TK_ptr, tokens, T, D,
    K: tl.constexpr, K_P2: tl.constexpr, ROWS: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[slots[t, k]] = src[t] (slots < 0 skipped); WEIGHTED: out[slots[t, k]] = w[t, k] * src[t] and
    dw[t, k] = <src[t], y[slots[t, k]]>. A src tile is loaded once, stored K times (a gather would read
    src K times). Slots are loaded in the column loop: hoisted, K pointer broadcasts spill (sm_90)."""
    tok_ok = tokens < T
    src_rows = tokens.to(tl.int64)[:, None] * D
    ks = tl.arange(0, K_P2)
    dot_RK = tl.zeros([ROWS, K_P2], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols[None, :] < D
        src = tl.load(src_TD_ptr + src_rows + cols[None, :], mask=tok_ok[:, None] & col_ok, other=0)
        for k in tl.static_range(K):
            slot = tl.load(slots_TK_ptr + tokens * K + k, mask=tok_ok, other=-1).to(tl.int64)
            m = (slot >= 0)[:, None] & col_ok
            out_p = out_ND_ptr + slot[:, None] * D + cols[None, :]
            if WEIGHTED:
                scale = tl.load(w_TK_ptr + tokens * K + k, mask=slot >= 0, other=0).to(tl.float32)
                tl.store(out_p, scale[:, None] * src.to(tl.float32), mask=m)
                y = tl.load(y_ND_ptr + slot[:, None] * D + cols[None, :], mask=m, other=0)
                part = tl.sum(src.to(tl.float32) * y.to(tl.float32), axis=1)
                dot_RK += tl.where(ks[None, :] == k, part[:, None], 0.0)
            else:
                tl.store(out_p, src.to(out_ND_ptr.dtype.element_ty), mask=m)
    if WEIGHTED:
        dw_p = dw_TK_ptr + tokens[:, None] * K + ks[None, :]
        tl.store(dw_p, dot_RK, mask=tok_ok[:, None] & (ks[None, :] < K))


# Store tile (TILE elements: CT rows x TILE / CT columns) and warps of the slots + scatter kernel. Several
# programs an SM let one's row stores hide another's index work (sm_90, top-8: 95 registers with a 4096
# tile, 5 programs an SM; 128 with 16384 at 8 warps, 2). Whole rows a store win at D=2048 (README).
_SLOTS_CONFIGS = [
    triton.Config({"TILE": t}, num_warps=w)
    for t, w in ((4096, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 8), (32768, 16), (32768, 32))
]
_SLOTS_CONFIGS = _SLOTS_CONFIGS[:1] if INTERPRET else _SLOTS_CONFIGS


@triton.autotune(_SLOTS_CONFIGS, key=["D", "K", "HAS_OWNER"])
@triton.jit
def _slots_scatter_kernel(
    x_TD_ptr, ids_TK_ptr, pre_CE_ptr, starts_E_ptr, slots_TK_ptr, owner_N_ptr, out_ND_ptr, T, D, E,
    K: tl.constexpr, K_P2: tl.constexpr, CT: tl.constexpr, HAS_OWNER: tl.constexpr, D_P2: tl.constexpr,
    PDL: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """Per chunk: slot = start[e] + pre[c, e] + earlier entries of e in the chunk (-1 for ids < 0), the
    map row -> entry (HAS_OWNER), then the token rows to their K slots. PDL: ranks before the wait."""
    BLOCK_D: tl.constexpr = TILE // CT if TILE // CT < D_P2 else D_P2
    c = tl.program_id(0)
    entries, ok, ids = _chunk_ids(ids_TK_ptr, c, T, K, CT)
    routed = ok & (ids >= 0)
    j = tl.arange(0, CHUNK)
    # Equal ids only: unrouted entries and empty lanes (-1) never add to a routed entry's rank.
    earlier = (ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    slot = tl.load(starts_E_ptr + ids, mask=routed, other=0)
    slot += tl.load(pre_CE_ptr + c * E + ids, mask=routed, other=0)
    slot = tl.where(routed, slot + rank, -1)
    tl.store(slots_TK_ptr + entries, slot.to(tl.int64), mask=ok)
    if HAS_OWNER:
        tl.store(owner_N_ptr + slot, entries, mask=routed)
    tl.debug_barrier()  # the row stores read back the slots other threads of this program just wrote
    _store_rows(
        x_TD_ptr, slots_TK_ptr, x_TD_ptr, x_TD_ptr, out_ND_ptr, out_ND_ptr, c * CT + tl.arange(0, CT), T, D,
        K, K_P2, CT, False, BLOCK_D,
    )  # fmt: skip


# Elements per program (ELEMS / BLOCK_D token rows, at least one) and warps of the row kernels.
_CONFIGS = [
    triton.Config({"ELEMS": e}, num_warps=w)
    for e, w in ((4096, 4), (4096, 8), (8192, 8), (16384, 8), (16384, 16), (2048, 4))
]
_CONFIGS = _CONFIGS[:1] if INTERPRET else _CONFIGS


@triton.autotune(_CONFIGS, key=["D", "K"])
@triton.jit
def _scatter_rows_kernel(
    src_TD_ptr, slots_TK_ptr, w_TK_ptr, y_ND_ptr, out_ND_ptr, dw_TK_ptr, T, D,
    K: tl.constexpr, K_P2: tl.constexpr, BLOCK_D: tl.constexpr, ELEMS: tl.constexpr,
):  # fmt: skip
    ROWS: tl.constexpr = (ELEMS + BLOCK_D - 1) // BLOCK_D
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    _store_rows(
        src_TD_ptr, slots_TK_ptr, w_TK_ptr, y_ND_ptr, out_ND_ptr, dw_TK_ptr, tokens, T, D,
        K, K_P2, ROWS, True, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _zero_unowned_rows_kernel(out_ND_ptr, owner_N_ptr, N, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows no (t, k) entry wrote (owner < 0) become zero."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    free = tl.load(owner_N_ptr + rows, mask=rows < N, other=0) < 0
    if tl.max(free.to(tl.int32), 0) == 0:  # nearly every program: all its rows are owned
        return
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        zero = tl.zeros([ROWS, BLOCK_D], dtype=out_ND_ptr.dtype.element_ty)
        p = out_ND_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(p, zero, mask=free[:, None] & (cols[None, :] < D))


@triton.autotune(_CONFIGS, key=["D", "K", "HAS_W"])
@triton.jit
def _combine_kernel(
    y_ND_ptr, slots_TK_ptr, w_TK_ptr, out_TD_ptr, T, D,
    K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr, ELEMS: tl.constexpr,
):  # fmt: skip
    """out[t] = sum_k w[t, k] * y[slots[t, k]] in fp32 (w = 1 without HAS_W); K unrolled so the K
    row gathers are in flight together."""
    ROWS: tl.constexpr = (ELEMS + BLOCK_D - 1) // BLOCK_D
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = tokens < T
    col_ok = cols[None, :] < D
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        slot = tl.load(slots_TK_ptr + tokens * K + k, mask=tok_ok, other=-1).to(tl.int64)
        hit = slot >= 0
        if HAS_W:
            w = tl.load(w_TK_ptr + tokens * K + k, mask=hit, other=0).to(tl.float32)
        else:
            w = hit.to(tl.float32)
        y = tl.load(y_ND_ptr + slot[:, None] * D + cols[None, :], mask=hit[:, None] & col_ok, other=0)
        acc += w[:, None] * y.to(tl.float32)
    out_off = tokens.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out_TD_ptr + out_off, acc, mask=tok_ok[:, None] & col_ok)


def _block_d(D: int) -> int:
    """Columns per step: 1024 bf16 = one 16-byte access per thread of 4 warps per row."""
    return min(triton.next_power_of_2(max(D, 1)), 1024)


def _zero_unowned(out_ND: Tensor, owner_N: Tensor) -> None:
    N, D = out_ND.shape
    if N * D:
        block_d = _block_d(D)
        rows = triton.cdiv(4096, block_d)
        _zero_unowned_rows_kernel[(triton.cdiv(N, rows),)](out_ND, owner_N, N, D, ROWS=rows, BLOCK_D=block_d)


def _combine(y_ND, slots_TK, w_TK=None):
    T, K = slots_TK.shape
    D = y_ND.shape[1]
    out = torch.empty(T, D, dtype=y_ND.dtype, device=y_ND.device)
    block_d = _block_d(D)
    if T * D == 0:
        return out
    grid = lambda meta: (triton.cdiv(T, triton.cdiv(meta["ELEMS"], block_d)), triton.cdiv(D, block_d))
    _combine_kernel[grid](
        y_ND, slots_TK, w_TK if w_TK is not None else slots_TK, out, T, D,
        K=K, HAS_W=w_TK is not None, BLOCK_D=block_d,
    )  # fmt: skip
    return out


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel starting while the one before finishes): sm_90 on."""
    return not INTERPRET and torch.cuda.get_device_capability(device)[0] >= 9


def _static_rows(T: int, K: int, num_experts: int, align: int, rows: int | None) -> int:
    return rows if rows is not None else T * K + num_experts * (align - 1)


def _permute_forward(
    x_TD: Tensor, expert_ids_TK: Tensor, num_experts: int, align: int, rows: int | None
) -> tuple[Tensor, Tensor, Tensor]:
    (T, K), D = expert_ids_TK.shape, x_TD.shape[1]
    E, dev = num_experts, x_TD.device
    N = _static_rows(T, K, E, align, rows)
    ids = expert_ids_TK.contiguous()
    x_ND = torch.empty(N, D, dtype=x_TD.dtype, device=dev)
    slots = torch.empty(T, K, dtype=torch.int64, device=dev)
    # Finds the rows no entry owns (padding, those past the entries in a given N).
    owner = torch.full((N,), -1, dtype=torch.int32, device=dev) if rows is not None or align > 1 else None
    if T * K == 0:
        ends = torch.zeros(E, dtype=torch.int32, device=dev)
    else:
        k_p2 = triton.next_power_of_2(K)
        ct = CHUNK.value // k_p2
        pdl = _has_pdl(dev)
        C = triton.cdiv(T, ct)
        counts_CE = torch.empty(C, E, dtype=torch.int32, device=dev)
        pre_CE = torch.empty_like(counts_CE)
        total_E, starts_E = torch.empty(2, E, dtype=torch.int32, device=dev)
        ends = torch.empty(E, dtype=torch.int32, device=dev)  # an output: its own storage, not a view
        arrivals = torch.empty(1, dtype=torch.int32, device=dev)  # reset by the first launch
        _chunk_histogram_kernel[(C,)](ids, counts_CE, arrivals, T, E, K=K, CT=ct, ET=EXPERT_TILE, num_warps=4)
        _histogram_scan_kernel[(triton.cdiv(E, EXPERT_SCAN),)](
            counts_CE, pre_CE, total_E, arrivals, starts_E, ends, C, E, align,
            CB=min(SCAN_CHUNKS, triton.next_power_of_2(C)), EB=EXPERT_SCAN, E_P2=triton.next_power_of_2(E),
            PDL=pdl, num_warps=8,
        )  # fmt: skip
        _slots_scatter_kernel[(C,)](
            x_TD, ids, pre_CE, starts_E, slots, owner if owner is not None else slots, x_ND, T, D, E,
            K=K, K_P2=k_p2, CT=ct, HAS_OWNER=owner is not None, D_P2=triton.next_power_of_2(max(D, 1)),
            PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    if owner is not None:
        _zero_unowned(x_ND, owner)
    return x_ND, slots, ends


def _permute_backward(dx_ND: Tensor, slots_TK: Tensor) -> Tensor:
    return _combine(dx_ND.contiguous(), slots_TK)


_permute_op = torch.library.custom_op("pith::moe_permute", _permute_forward, mutates_args=())
_permute_backward_op = torch.library.custom_op(
    "pith::moe_permute_backward", _permute_backward, mutates_args=()
)


@_permute_op.register_fake
def _(x_TD, expert_ids_TK, num_experts, align, rows):
    T, K = expert_ids_TK.shape
    N = _static_rows(T, K, num_experts, align, rows)
    return (
        x_TD.new_empty(N, x_TD.shape[1]),
        expert_ids_TK.new_empty(T, K, dtype=torch.int64),
        expert_ids_TK.new_empty(num_experts, dtype=torch.int32),
    )


@_permute_backward_op.register_fake
def _(dx_ND, slots_TK):
    return dx_ND.new_empty(slots_TK.shape[0], dx_ND.shape[1])


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1], output[2])


def _permute_grads(backward, ctx, dx_ND, _dslots, _dends):
    (slots_TK,) = ctx.saved_tensors
    return backward(dx_ND, slots_TK), None, None, None, None


_permute = eager_or_custom(
    _permute_op, _permute_setup, _permute_forward, _permute_grads, _permute_backward_op, _permute_backward
)


class _StandIn(torch.autograd.Function):
    """Zeros [N, D] of strides 0 standing for x's permuted rows, with moe_permute's gradient."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, slots_TK: Tensor, N: int) -> Tensor:
        ctx.save_for_backward(slots_TK)
        return torch.zeros((), dtype=x_TD.dtype, device=x_TD.device).expand(N, x_TD.shape[1])

    @staticmethod
    def backward(ctx, dx_ND: Tensor):
        (slots_TK,) = ctx.saved_tensors
        if not use_triton(dx_ND):
            ones = torch.ones(slots_TK.shape, device=dx_ND.device)
            return moe_unpermute_reference(dx_ND, slots_TK, ones), None, None
        return _permute_backward(dx_ND, slots_TK), None, None


def _permute_fp8(x8: FP8Rows, expert_ids_TK: Tensor, num_experts: int, align: int, rows: int | None):
    """The e4m3 rows permuted as bytes, the scales by the same slots (0 where unowned), x by a stand-in."""
    check("x_TD.q", x8.q, ndim=2, dtypes=(FP8,), contiguous=True)
    check("x_TD.scale", x8.scale, ndim=1, dtypes=(torch.float32,), device=x8.q.device)
    if x8.x.shape != x8.q.shape or x8.scale.shape[0] != x8.q.shape[0]:
        raise ValueError(
            f"x_TD: expected x of q's shape {tuple(x8.q.shape)} and one scale per row, got x"
            f" {tuple(x8.x.shape)} and {x8.scale.shape[0]} scales"
        )
    q_ND, slots_TK, ends_E = moe_permute(x8.q.view(torch.uint8), expert_ids_TK, num_experts, align, rows=rows)
    N = q_ND.shape[0]
    scale_N = x8.scale.new_zeros(N + 1)  # entries without a slot write to row N, cut off
    scale_N.scatter_(
        0, torch.where(slots_TK < 0, N, slots_TK).flatten(), x8.scale.repeat_interleave(slots_TK.shape[1])
    )
    return FP8Rows(_StandIn.apply(x8.x, slots_TK, N), q_ND.view(FP8), scale_N[:N]), slots_TK, ends_E


def moe_permute(
    x_TD: Tensor | FP8Rows, expert_ids_TK: Tensor, num_experts: int, align: int = 1, *,
    rows: int | None = None,
) -> tuple[Tensor | FP8Rows, Tensor, Tensor]:  # fmt: skip
    """-> (x_ND, slots_TK int64, group_ends_E int32), laid out as moe_permute_reference's. x_TD may be
    bytes (uint8: no gradient), or FP8Rows (fp8_rows), which give FP8Rows."""
    if isinstance(x_TD, FP8Rows):
        return _permute_fp8(x_TD, expert_ids_TK, num_experts, align, rows)
    check("x_TD", x_TD, ndim=2, dtypes=(*FLOAT_DTYPES, torch.uint8), contiguous=True)
    check("expert_ids_TK", expert_ids_TK, ndim=2, dtypes=INDEX_DTYPES, device=x_TD.device)
    if expert_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"expert_ids_TK: expected {x_TD.shape[0]} rows (one per token), got {expert_ids_TK.shape[0]}"
        )
    if expert_ids_TK.shape[1] > CHUNK.value:
        raise ValueError(
            f"expert_ids_TK: expected at most {CHUNK.value} columns (top-k), got {expert_ids_TK.shape[1]}"
        )
    if not 1 <= num_experts <= 4096:
        raise ValueError(f"num_experts: expected 1..4096, got {num_experts}")
    if align < 1:
        raise ValueError(f"align: expected a positive row multiple, got {align}")
    need = num_experts * (align - 1)
    # Data-dependent checks (a host sync on CUDA, a graph break under compile): eager CPU only.
    if not expert_ids_TK.is_cuda and not torch.compiler.is_compiling():
        hi = int(expert_ids_TK.max()) if expert_ids_TK.numel() else -1
        if hi >= num_experts:
            raise ValueError(f"expert_ids_TK: expected ids < {num_experts} (< 0: no expert), got {hi}")
        if rows is not None:
            need += int((expert_ids_TK >= 0).sum())
    if rows is not None and rows < need:
        raise ValueError(f"rows: expected at least {need} (routed entries plus padding), got {rows}")
    if not use_triton(x_TD):
        return moe_permute_reference(x_TD, expert_ids_TK, num_experts, align, rows=rows)
    return _permute(x_TD, expert_ids_TK, num_experts, align, rows)


def _unpermute_forward(y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
    return _combine(y_ND, slots_TK.contiguous(), weights_TK.contiguous())


def _unpermute_backward(
    dout_TD: Tensor, y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor
) -> tuple[Tensor, Tensor]:
    (T, K), (N, D), dev = slots_TK.shape, y_ND.shape, y_ND.device
    flat = slots_TK.reshape(-1)
    # Row N is a sink for slots < 0 (a boolean mask would sync).
    owner = torch.full((N + 1,), -1, dtype=torch.int32, device=dev)
    owner.scatter_(
        0, torch.where(flat < 0, N, flat).long(), torch.arange(T * K, dtype=torch.int32, device=dev)
    )
    dy = torch.empty(N, D, dtype=y_ND.dtype, device=dev)
    dw = torch.empty(T, K, dtype=torch.float32, device=dev)
    if T:
        block_d = _block_d(D)
        _scatter_rows_kernel[lambda meta: (triton.cdiv(T, triton.cdiv(meta["ELEMS"], block_d)),)](
            dout_TD.contiguous(), slots_TK.contiguous(), weights_TK.contiguous(), y_ND, dy, dw, T, D,
            K=K, K_P2=triton.next_power_of_2(K), BLOCK_D=block_d,
        )  # fmt: skip
    _zero_unowned(dy, owner[:N])
    return dy, dw.to(weights_TK.dtype)


_unpermute_op = torch.library.custom_op("pith::moe_unpermute", _unpermute_forward, mutates_args=())
_unpermute_backward_op = torch.library.custom_op(
    "pith::moe_unpermute_backward", _unpermute_backward, mutates_args=()
)


@_unpermute_op.register_fake
def _(y_ND, slots_TK, weights_TK):
    return y_ND.new_empty(slots_TK.shape[0], y_ND.shape[1])


@_unpermute_backward_op.register_fake
def _(dout_TD, y_ND, slots_TK, weights_TK):
    return torch.empty_like(y_ND), torch.empty_like(weights_TK)


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_grads(backward, ctx, dout_TD):
    dy, dw = backward(dout_TD, *ctx.saved_tensors)
    return dy, None, dw


_unpermute = eager_or_custom(
    _unpermute_op,
    _unpermute_setup,
    _unpermute_forward,
    _unpermute_grads,
    _unpermute_backward_op,
    _unpermute_backward,
)


def moe_unpermute(y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """moe_unpermute_reference."""
    check("y_ND", y_ND, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    check("slots_TK", slots_TK, ndim=2, dtypes=INDEX_DTYPES, device=y_ND.device)
    check("weights_TK", weights_TK, ndim=2, dtypes=FLOAT_DTYPES, device=y_ND.device)
    if weights_TK.shape != slots_TK.shape:
        raise ValueError(
            f"weights_TK: expected shape {tuple(slots_TK.shape)} (slots_TK's), got {tuple(weights_TK.shape)}"
        )
    if not use_triton(y_ND):
        return moe_unpermute_reference(y_ND, slots_TK, weights_TK)
    return _unpermute(y_ND, slots_TK, weights_TK)


def moe_permute_reference(
    x_TD: Tensor, expert_ids_TK: Tensor, num_experts: int, align: int = 1, *, rows: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (x_ND, slots_TK, group_ends_E): expert e's rows are [group_ends[e-1], group_ends[e]) (starts
    padded to a multiple of `align`), in token order; slots[t, k] is the row of (t, k), -1 where
    expert_ids[t, k] < 0. N: `rows` (at least the routed entries plus E*(align-1)), else T*K +
    E*(align-1). Rows no entry owns are zero (the kernels leave the tail past group_ends[-1] unwritten
    without `rows` at align 1)."""
    T, K = expert_ids_TK.shape
    E = num_experts
    flat = expert_ids_TK.reshape(-1).long()
    routed = flat >= 0
    # scatter_add rather than bincount, which syncs with the host on CUDA (no CUDA-graph capture).
    counts = flat.new_zeros(E).scatter_add_(0, flat.clamp(min=0), routed.long())
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(torch.where(routed, flat, E), stable=True)  # unrouted entries last
    e_sorted = flat[order].clamp(min=0)
    rank_in_expert = torch.arange(T * K, device=flat.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    slots = torch.empty_like(flat).scatter_(0, order, starts[e_sorted] + rank_in_expert)
    slots = torch.where(routed, slots, -1)
    N = _static_rows(T, K, E, align, rows)
    # Each row's token, T (a zero row appended to x) where unowned; unrouted entries write to a sink N
    # (no boolean mask: no host sync). A gather of N rows, not a scatter of T*K: fewer under EP.
    token_N = torch.full((N + 1,), T, dtype=torch.long, device=flat.device)
    token_N.scatter_(0, torch.where(routed, slots, N), torch.arange(T * K, device=flat.device) // K)
    x_ND = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])[token_N[:N]]
    return x_ND, slots.view(T, K), ends.to(torch.int32)


def moe_unpermute_reference(y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """out[t] = sum_k weights[t, k] * y[slots[t, k]] (slots < 0 contribute nothing), fp32 sum, y's dtype."""
    acc = torch.promote_types(y_ND.dtype, torch.float32)
    valid = slots_TK >= 0
    # Slots < 0 read a zero row appended to y (an empty y works too).
    y_ND = torch.cat([y_ND, y_ND.new_zeros(1, y_ND.shape[1])])
    rows = y_ND[torch.where(valid, slots_TK, y_ND.shape[0] - 1)].to(acc)  # [T, K, D]
    w = torch.where(valid, weights_TK.to(acc), 0.0)
    return (rows * w[..., None]).sum(1).to(y_ND.dtype)
