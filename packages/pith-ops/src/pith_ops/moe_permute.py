"""Group token rows by expert (moe_permute) and the weighted combine back (moe_unpermute).

Shape legend: T tokens, K router top-k, D model dim, E experts, N grouped rows (T*K, plus per-expert
padding when align > 1), C chunks of CHUNK routed entries, B blocks of CHUNKS_PER_BLOCK chunks.

Index building is three launches with no host sync and no torch op between them: per block, each
chunk's per-expert counts in the block's earlier chunks and the block's totals; one program scanning
the [E, B] totals into expert starts (padded to `align`) plus entries in earlier blocks; per chunk, each
entry's slot (that base + the earlier-chunks count + earlier entries of its expert in the chunk) and,
with padding, the owner map row -> entry. Token rows are then scattered to their K slots (each tile
read once, stored K times), and only the rows no entry owns (padding) are zero-filled.
Eager calls skip the custom ops' dispatch layers (_common.eager_or_custom); torch.compile sees the
custom ops (one opaque node each), whose bodies are the same functions.

Expert ids outside [0, E) are checked only for CPU tensors in eager mode: on CUDA the check would
cost a host sync per call, so there they are the caller's contract (a router's top-k cannot produce
them).
moe_unpermute requires that no row of y is referenced by two (t, k) entries (true for the slots
moe_permute returns); its backward scatters w * dout to the referenced rows of dy, computing the
weight gradient from the same loads, and zero-fills the rows no slot references.
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from pith_ops._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    INTERPRET,
    check,
    eager_or_custom,
    use_triton,
)

CHUNK = 128  # routed entries per slot program; the in-chunk rank is a CHUNK x CHUNK compare
CHUNKS_PER_BLOCK = 8  # chunks per histogram program: 1024 entries, so E x blocks stays one small scan
# Experts per step of the chunk histograms: a [8, 128, 16] compare is 64 values a thread on the GPU; the
# interpreter pays per step, not per value (4096 experts in steps of 16: 10 s a call on CPU).
EXPERT_TILE = 256 if INTERPRET else 16


@triton.jit
def _histogram_kernel(
    ids_ptr, pre_CE_ptr, hist_EB_ptr, TK, E, NB,
    CHUNK: tl.constexpr, CPB: tl.constexpr, ET: tl.constexpr,
):  # fmt: skip
    """Per chunk: entries of each expert in earlier chunks of the same block (pre); per block: totals.

    Counted by comparison against a tile of experts rather than tl.histogram: one histogram per chunk
    would be CPB dependent steps, one over (chunk, expert) bins costs the GPU lowering O(bins) per value.
    """
    b = tl.program_id(0)
    chunks = b * CPB + tl.arange(0, CPB)
    offs = chunks[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    ids = tl.load(ids_ptr + offs, mask=offs < TK, other=-1).to(tl.int32)  # -1 matches no expert
    for e0 in range(0, E, ET):
        experts = e0 + tl.arange(0, ET)
        counts = tl.sum((ids[:, :, None] == experts[None, None, :]).to(tl.int32), axis=1)  # [CPB, ET]
        incl = tl.cumsum(counts, 0)
        e_ok = experts < E
        tl.store(pre_CE_ptr + chunks[:, None] * E + experts[None, :], incl - counts, mask=e_ok[None, :])
        tl.store(hist_EB_ptr + experts * NB + b, tl.sum(counts, 0), mask=e_ok)


@triton.jit
def _scan_kernel(hist_EB_ptr, base_EB_ptr, ends_ptr, E, NB, align, E_P2: tl.constexpr, BT: tl.constexpr):
    """One program: expert totals -> padded group ends; base[e, b] = e's start + its entries in blocks < b."""
    experts = tl.arange(0, E_P2)
    e_ok = experts < E
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for b0 in range(0, NB, BT):
        blocks = b0 + tl.arange(0, BT)
        m = e_ok[:, None] & (blocks[None, :] < NB)
        counts += tl.sum(tl.load(hist_EB_ptr + experts[:, None] * NB + blocks[None, :], mask=m, other=0), 1)
    padded = (counts + align - 1) // align * align
    ends = tl.cumsum(padded, 0)
    tl.store(ends_ptr + experts, ends, mask=e_ok)
    carry = ends - padded
    for b0 in range(0, NB, BT):
        blocks = b0 + tl.arange(0, BT)
        p = experts[:, None] * NB + blocks[None, :]
        m = e_ok[:, None] & (blocks[None, :] < NB)
        hist = tl.load(hist_EB_ptr + p, mask=m, other=0)
        tl.store(base_EB_ptr + p, carry[:, None] + tl.cumsum(hist, 1) - hist, mask=m)
        carry += tl.sum(hist, 1)


@triton.jit
def _slots_kernel(
    ids_ptr, pre_CE_ptr, base_EB_ptr, slots_ptr, inv_ptr, TK, E, NB,
    CHUNK: tl.constexpr, CPB: tl.constexpr, HAS_OWNER: tl.constexpr,
):  # fmt: skip
    """slot = base[e, block] + entries of e in earlier chunks of the block + earlier entries in the chunk."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < TK
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    base = tl.load(base_EB_ptr + ids * NB + c // CPB, mask=valid, other=0)
    pre = tl.load(pre_CE_ptr + c * E + ids, mask=valid, other=0)
    j = tl.arange(0, CHUNK)
    earlier = (ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None])
    slot = base + pre + tl.sum(earlier.to(tl.int32), axis=1)
    tl.store(slots_ptr + offs, slot.to(tl.int64), mask=valid)
    if HAS_OWNER:
        tl.store(inv_ptr + slot, offs, mask=valid)


# Elements per program (ROWS = ELEMS / BLOCK_D token rows, at least one) and warps for the row kernels,
# autotuned per shape on the GPU; the interpreter (CPU tests) would run every config, so it gets one.
_CONFIGS = [
    triton.Config({"ELEMS": e}, num_warps=w)
    for e, w in ((4096, 4), (4096, 8), (8192, 8), (16384, 8), (16384, 16), (2048, 4))
]
_CONFIGS = _CONFIGS[:1] if INTERPRET else _CONFIGS


@triton.autotune(_CONFIGS, key=["D", "K", "HAS_W", "HAS_Y"])
@triton.jit
def _scatter_rows_kernel(
    src_TD_ptr, slots_TK_ptr, w_TK_ptr, y_ND_ptr, out_ND_ptr, dw_TK_ptr, T, D,
    K: tl.constexpr, K_P2: tl.constexpr, HAS_W: tl.constexpr, HAS_Y: tl.constexpr,
    BLOCK_D: tl.constexpr, ELEMS: tl.constexpr,
):  # fmt: skip
    """out[slots[t, k]] = w[t, k] * src[t] (slots < 0 skipped); HAS_Y: dw[t, k] = <src[t], y[slots[t, k]]>.

    Each src tile is loaded once and stored to its K destinations (K unrolled, so the stores and, with
    HAS_Y, the y loads of all K are in flight together); gathering by output row instead would fetch
    each src row K times, and src is larger than L2 at training sizes.
    """
    ROWS: tl.constexpr = (ELEMS + BLOCK_D - 1) // BLOCK_D
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
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
            if HAS_W:
                scale = tl.load(w_TK_ptr + tokens * K + k, mask=slot >= 0, other=0).to(tl.float32)
                tl.store(out_p, scale[:, None] * src.to(tl.float32), mask=m)
            else:
                tl.store(out_p, src.to(out_ND_ptr.dtype.element_ty), mask=m)
            if HAS_Y:
                y = tl.load(y_ND_ptr + slot[:, None] * D + cols[None, :], mask=m, other=0)
                part = tl.sum(src.to(tl.float32) * y.to(tl.float32), axis=1)
                dot_RK += tl.where(ks[None, :] == k, part[:, None], 0.0)
    if HAS_Y:
        dw_p = dw_TK_ptr + tokens[:, None] * K + ks[None, :]
        tl.store(dw_p, dot_RK, mask=tok_ok[:, None] & (ks[None, :] < K))


@triton.jit
def _zero_unowned_rows_kernel(out_ND_ptr, owner_N_ptr, N, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows no (t, k) entry wrote (owner < 0: padding, or rows a caller's slots skip) become zero."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    free = tl.load(owner_N_ptr + rows, mask=rows < N, other=0) < 0
    if tl.max(free.to(tl.int32), 0) == 0:  # nearly every program: all its rows are owned
        return
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        p = out_ND_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(
            p,
            tl.zeros([ROWS, BLOCK_D], dtype=out_ND_ptr.dtype.element_ty),
            mask=free[:, None] & (cols[None, :] < D),
        )


@triton.autotune(_CONFIGS, key=["D", "K", "HAS_W"])
@triton.jit
def _combine_kernel(
    y_ND_ptr, slots_TK_ptr, w_TK_ptr, out_TD_ptr, T, D,
    K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr, ELEMS: tl.constexpr,
):  # fmt: skip
    """out[t] = sum_k w[t, k] * y[slots[t, k]] in fp32 (slots < 0 skipped; w = 1 without HAS_W).
    K is unrolled so the K row gathers are in flight together rather than one load latency each."""
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


def _rows(meta: dict, block_d: int) -> int:
    return triton.cdiv(meta["ELEMS"], block_d)


def _scatter_rows(src_TD, slots_TK, N, owner_N, w_TK=None, y_ND=None, out_dtype=None):
    """-> (out_ND, dw_TK fp32 or None): the scatter, then zeros in the rows no entry owns."""
    (T, K), D = slots_TK.shape, src_TD.shape[1]
    out = torch.empty(N, D, dtype=out_dtype or src_TD.dtype, device=src_TD.device)
    dw = torch.empty(T, K, dtype=torch.float32, device=src_TD.device) if y_ND is not None else None
    block_d = _block_d(D)
    if T:
        _scatter_rows_kernel[lambda meta: (triton.cdiv(T, _rows(meta, block_d)),)](
            src_TD, slots_TK, w_TK if w_TK is not None else slots_TK, y_ND if y_ND is not None else out,
            out, dw if dw is not None else out, T, D,
            K=K, K_P2=triton.next_power_of_2(K), HAS_W=w_TK is not None, HAS_Y=y_ND is not None,
            BLOCK_D=block_d,
        )  # fmt: skip
    if owner_N is not None and N * D:
        rows = triton.cdiv(4096, block_d)
        _zero_unowned_rows_kernel[(triton.cdiv(N, rows),)](out, owner_N, N, D, ROWS=rows, BLOCK_D=block_d)
    return out, dw


def _combine(y_ND, slots_TK, w_TK=None):
    T, K = slots_TK.shape
    D = y_ND.shape[1]
    out = torch.empty(T, D, dtype=y_ND.dtype, device=y_ND.device)
    block_d = _block_d(D)
    if T * D == 0:
        return out
    _combine_kernel[lambda meta: (triton.cdiv(T, _rows(meta, block_d)), triton.cdiv(D, block_d))](
        y_ND, slots_TK, w_TK if w_TK is not None else slots_TK, out, T, D,
        K=K, HAS_W=w_TK is not None, BLOCK_D=block_d,
    )  # fmt: skip
    return out


def _static_rows(T: int, K: int, num_experts: int, align: int) -> int:
    return T * K + num_experts * (align - 1) if align > 1 else T * K


# --- moe_permute ---------------------------------------------------------------------------------


def _permute_forward(
    x_TD: Tensor, expert_ids_TK: Tensor, num_experts: int, align: int
) -> tuple[Tensor, Tensor, Tensor]:
    T, K = expert_ids_TK.shape
    TK, E, dev = T * K, num_experts, x_TD.device
    N = _static_rows(T, K, E, align)
    ids = expert_ids_TK.contiguous().view(-1)
    n_chunks = triton.cdiv(TK, CHUNK)
    nb = triton.cdiv(n_chunks, CHUNKS_PER_BLOCK)
    slots = torch.empty(TK, dtype=torch.int64, device=dev)
    # The owner map is needed only to find padding rows; without padding every row is some entry's.
    inv = torch.full((N,), -1, dtype=torch.int32, device=dev) if align > 1 else None
    # The scan kernel writes every expert's end; only with no entries do they need a zero fill.
    ends = (
        torch.empty(E, dtype=torch.int32, device=dev) if TK else torch.zeros(E, dtype=torch.int32, device=dev)
    )
    if TK:
        # Three launches, no torch op between them: chunk/block histograms, one program scanning the
        # [E, blocks] table (128 x 128 at T=16384, K=8, E=128), the slots.
        pre_CE = torch.empty(nb * CHUNKS_PER_BLOCK, E, dtype=torch.int32, device=dev)
        hist_EB = torch.empty(E, nb, dtype=torch.int32, device=dev)
        base_EB = torch.empty_like(hist_EB)
        _histogram_kernel[(nb,)](
            ids, pre_CE, hist_EB, TK, E, nb, CHUNK=CHUNK, CPB=CHUNKS_PER_BLOCK, ET=EXPERT_TILE, num_warps=8
        )
        e_p2 = triton.next_power_of_2(E)
        _scan_kernel[(1,)](
            hist_EB, base_EB, ends, E, nb, align, E_P2=e_p2, BT=max(1, 16384 // e_p2), num_warps=16
        )
        _slots_kernel[(n_chunks,)](
            ids, pre_CE, base_EB, slots, inv if inv is not None else slots, TK, E, nb,
            CHUNK=CHUNK, CPB=CHUNKS_PER_BLOCK, HAS_OWNER=inv is not None, num_warps=8,  # [128, 128] compare
        )  # fmt: skip
    x_ND, _ = _scatter_rows(x_TD, slots.view(T, K), N, inv)
    return x_ND, slots.view(T, K), ends


def _permute_backward(dx_ND: Tensor, slots_TK: Tensor) -> Tensor:
    # Each token's K copies sum back: the unweighted combine.
    return _combine(dx_ND.contiguous(), slots_TK)


_permute_op = torch.library.custom_op("pith::moe_permute", _permute_forward, mutates_args=())
_permute_backward_op = torch.library.custom_op(
    "pith::moe_permute_backward", _permute_backward, mutates_args=()
)


@_permute_op.register_fake
def _(x_TD, expert_ids_TK, num_experts, align):
    T, K = expert_ids_TK.shape
    N = _static_rows(T, K, num_experts, align)
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


def _permute_grads(ctx, dx_ND, _dslots, _dends, backward):
    (slots_TK,) = ctx.saved_tensors
    return backward(dx_ND, slots_TK), None, None, None


_permute_op.register_autograd(
    functools.partial(_permute_grads, backward=_permute_backward_op), setup_context=_permute_setup
)
_permute = eager_or_custom(
    _permute_op,
    _permute_setup,
    _permute_forward,
    functools.partial(_permute_grads, backward=_permute_backward),
)


def moe_permute(
    x_TD: Tensor, expert_ids_TK: Tensor, num_experts: int, align: int = 1
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (x_ND, slots_TK int64, group_ends_E int32); see moe_permute_reference for the layout."""
    check("x_TD", x_TD, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    check("expert_ids_TK", expert_ids_TK, ndim=2, dtypes=INDEX_DTYPES, device=x_TD.device)
    if expert_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"expert_ids_TK: expected {x_TD.shape[0]} rows (one per token), got {expert_ids_TK.shape[0]}"
        )
    if not 1 <= num_experts <= 4096:
        raise ValueError(f"num_experts: expected 1..4096, got {num_experts}")
    if align < 1:
        raise ValueError(f"align: expected a positive row multiple, got {align}")
    # A data-dependent check (a host sync on CUDA, a graph break under compile): eager CPU only.
    if not expert_ids_TK.is_cuda and expert_ids_TK.numel() and not torch.compiler.is_compiling():
        lo, hi = int(expert_ids_TK.min()), int(expert_ids_TK.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_ids_TK: expected ids in [0, {num_experts}), got ids in [{lo}, {hi}]")
    if not use_triton(x_TD):
        return moe_permute_reference(x_TD, expert_ids_TK, num_experts, align)
    return _permute(x_TD, expert_ids_TK, num_experts, align)


# --- moe_unpermute -------------------------------------------------------------------------------


def _unpermute_forward(y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
    return _combine(y_ND, slots_TK.contiguous(), weights_TK.contiguous())


def _unpermute_backward(
    dout_TD: Tensor, y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor
) -> tuple[Tensor, Tensor]:
    N = y_ND.shape[0]
    flat = slots_TK.reshape(-1)
    # Owner map for the zero fill; row N is a sink for slots < 0, so no boolean mask (a sync) is needed.
    inv = torch.full((N + 1,), -1, dtype=torch.int32, device=y_ND.device)
    inv.scatter_(
        0,
        torch.where(flat < 0, N, flat).long(),
        torch.arange(flat.numel(), dtype=torch.int32, device=y_ND.device),
    )
    dy, dw = _scatter_rows(
        dout_TD.contiguous(),
        slots_TK.contiguous(),
        N,
        inv[:N],
        w_TK=weights_TK.contiguous(),
        y_ND=y_ND,
        out_dtype=y_ND.dtype,
    )
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


def _unpermute_grads(ctx, dout_TD, backward):
    dy, dw = backward(dout_TD, *ctx.saved_tensors)
    return dy, None, dw


_unpermute_op.register_autograd(
    functools.partial(_unpermute_grads, backward=_unpermute_backward_op),
    setup_context=_unpermute_setup,
)
_unpermute = eager_or_custom(
    _unpermute_op,
    _unpermute_setup,
    _unpermute_forward,
    functools.partial(_unpermute_grads, backward=_unpermute_backward),
)


def moe_unpermute(y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """out_TD = sum_k weights[t, k] * y[slots[t, k]] (fp32 sum, y's dtype; slots < 0 contribute nothing)."""
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


# --- specification -------------------------------------------------------------------------------


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
    # scatter_add rather than bincount, which syncs with the host on CUDA (no CUDA-graph capture).
    counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    rank_in_expert = torch.arange(T * K, device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    slots = torch.empty_like(flat)
    slots[order] = starts[flat[order]] + rank_in_expert
    x_ND = x_TD.new_zeros(_static_rows(T, K, num_experts, align), x_TD.shape[1])
    x_ND[slots] = x_TD.repeat_interleave(K, dim=0)
    return x_ND, slots.view(T, K), ends.to(torch.int32)


def moe_unpermute_reference(y_ND: Tensor, slots_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """out[t] = sum_k weights[t, k] * y[slots[t, k]] (slots < 0 contribute nothing), fp32 sum, y's dtype."""
    acc = torch.promote_types(y_ND.dtype, torch.float32)  # float64 stays float64 for the tests
    valid = slots_TK >= 0
    rows = y_ND[slots_TK.clamp(min=0)].to(acc)  # [T, K, D]
    w = torch.where(valid, weights_TK.to(acc), 0.0)
    return (rows * w[..., None]).sum(1).to(y_ND.dtype)
