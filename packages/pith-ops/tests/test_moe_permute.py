"""moe_permute / moe_unpermute against their float64 reference: outputs, every gradient, opcheck, errors.

Shape legend: T tokens, K top-k, D model dim, E experts, N grouped rows.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import (
    FP8Rows,
    fp8_rows,
    moe_permute,
    moe_permute_reference,
    moe_unpermute,
    moe_unpermute_reference,
)


def routing(T: int, K: int, E: int, seed: int, device="cpu", unrouted=0.0) -> torch.Tensor:
    """Top-k style ids: K distinct experts per token (K <= E); with unrouted > 0, that share of the ids
    and every id of token 0 are -1 (no expert)."""
    g = torch.Generator().manual_seed(seed)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if unrouted:
        ids_TK = torch.where(torch.rand(T, K, generator=g) < unrouted, -1, ids_TK)
        ids_TK[:1] = -1
    return ids_TK.to(device)


def permute_by_hand(x_TD, ids_TK, E, align, N):
    """The layout spelled out entry by entry: (expert, token) order, each group start rounded up to a
    multiple of align, ids < 0 no row. -> (x_ND, slots_TK, group_ends_E)."""
    T, K = ids_TK.shape
    entries_of = [[] for _ in range(E)]
    for t, ids in enumerate(ids_TK.tolist()):
        for k, e in enumerate(ids):
            if e >= 0:
                entries_of[e].append((t, k))
    x_ND = torch.zeros(N, x_TD.shape[1], dtype=x_TD.dtype)
    slots, ends, row = [[-1] * K for _ in range(T)], [], 0
    for entries in entries_of:
        for t, k in entries:
            x_ND[row], slots[t][k], row = x_TD[t], row, row + 1
        row = -(-row // align) * align
        ends.append(row)
    return x_ND, torch.tensor(slots, dtype=torch.long).view(T, K), torch.tensor(ends, dtype=torch.int32)


def check_permute(
    T, K, E, D, align, seed, dtype=torch.float32, device="cpu", tol=1e-5, unrouted=0.0, spare_rows=None
):
    """spare_rows: None for the default N, else pass rows = (the routed entries + padding) + spare_rows."""
    g = torch.Generator().manual_seed(seed)
    ids_TK = routing(T, K, E, seed, device, unrouted)
    pad = E * (align - 1)
    rows = None if spare_rows is None else int((ids_TK >= 0).sum()) + pad + spare_rows
    x_TD = torch.randn(T, D, generator=g).to(device, dtype).requires_grad_()
    x_ND, slots_TK, ends_E = moe_permute(x_TD, ids_TK, E, align, rows=rows)
    x64 = x_TD.detach().double().requires_grad_()
    ref_ND, ref_slots, ref_ends = moe_permute_reference(x64, ids_TK, E, align, rows=rows)
    N = T * K + pad if rows is None else rows
    assert x_ND.shape == ref_ND.shape == (N, D)
    by_hand = permute_by_hand(x64.detach().cpu(), ids_TK.cpu(), E, align, N)  # the reference's own spec
    for got, want in zip((ref_ND, ref_slots, ref_ends), by_hand):
        assert torch.equal(got.detach().cpu(), want)
    assert torch.equal(slots_TK, ref_slots) and torch.equal(ends_E, ref_ends)
    # Rows no entry owns are zero, except the tail negative ids leave without rows or padding (unwritten).
    written = N if rows is not None or align > 1 else int(ends_E[-1])
    torch.testing.assert_close(x_ND[:written].double(), ref_ND[:written], rtol=0, atol=0)  # exact copies

    dx_ND = torch.randn(x_ND.shape, generator=g).to(device, dtype)
    (dx,) = torch.autograd.grad(x_ND, x_TD, dx_ND)
    (ref_dx,) = torch.autograd.grad(ref_ND, x64, dx_ND.double())
    torch.testing.assert_close(dx.double(), ref_dx, rtol=tol, atol=tol)

    # Combine back through the permutation's own slots, some masked out with -1.
    slots_TK = torch.where(torch.rand(T, K, generator=g).to(device) < 0.2, -1, slots_TK)
    y_ND = torch.randn(x_ND.shape, generator=g).to(device, dtype).requires_grad_()
    w_TK = torch.rand(T, K, generator=g).to(device).requires_grad_()
    out = moe_unpermute(y_ND, slots_TK, w_TK)
    y64, w64 = y_ND.detach().double().requires_grad_(), w_TK.detach().double().requires_grad_()
    ref = moe_unpermute_reference(y64, slots_TK, w64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    dout = torch.randn(T, D, generator=g).to(device, dtype)
    dy, dw = torch.autograd.grad(out, (y_ND, w_TK), dout)
    ref_dy, ref_dw = torch.autograd.grad(ref, (y64, w64), dout.double())
    torch.testing.assert_close(dy.double(), ref_dy, rtol=tol, atol=tol)
    torch.testing.assert_close(dw.double(), ref_dw, rtol=tol, atol=tol * D)


# Experts, then a top-k that fits (routing draws K distinct experts per token).
experts_and_top_k = st.integers(1, 256).flatmap(lambda E: st.tuples(st.just(E), st.integers(1, min(E, 8))))


@given(
    T=st.integers(1, 40),
    E_K=experts_and_top_k,
    D=st.integers(1, 24),
    align=st.sampled_from([1, 2, 8]),
    seed=st.integers(0, 2**16),
    unrouted=st.sampled_from([0.0, 0.3, 1.0]),
    spare_rows=st.sampled_from([None, 0, 5]),
)
def test_permute_and_unpermute_match_reference_with_gradients(T, E_K, D, align, seed, unrouted, spare_rows):
    E, K = E_K
    check_permute(T, K, E, D, align, seed, unrouted=unrouted, spare_rows=spare_rows)


@given(
    T=st.integers(1, 30),
    E_K=experts_and_top_k,
    D=st.integers(1, 40),
    align=st.sampled_from([1, 16]),
    seed=st.integers(0, 2**16),
    unrouted=st.sampled_from([0.0, 0.4]),
    spare_rows=st.sampled_from([None, 3]),
)
def test_fp8_rows_permute_as_bytes_with_their_scales_and_the_gradient_of_the_plain_rows(
    T, E_K, D, align, seed, unrouted, spare_rows
):
    """FP8Rows: each (t, k) row holds token t's e4m3 row and scale (rows no entry owns: zeros, scale
    0), slots and ends are the plain permutation's, x is a stand-in (strides 0, zeros) whose gradient
    is the plain rows' bit for bit."""
    E, K = E_K
    ids_TK = routing(T, K, E, seed, unrouted=unrouted)
    rows = None if spare_rows is None else int((ids_TK >= 0).sum()) + E * (align - 1) + spare_rows
    x_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(seed)).mul(10.0).requires_grad_()
    x8 = fp8_rows(x_TD)
    got, slots_TK, ends_E = moe_permute(x8, ids_TK, E, align, rows=rows)
    plain, want_slots, want_ends = moe_permute(x_TD, ids_TK, E, align, rows=rows)
    assert isinstance(got, FP8Rows) and torch.equal(slots_TK, want_slots) and torch.equal(ends_E, want_ends)
    assert got.x.shape == got.q.shape == plain.shape and not any(got.x.stride()) and not got.x.any()
    N = plain.shape[0]
    owned = slots_TK.flatten() >= 0
    row, token = slots_TK.flatten()[owned], torch.arange(T).repeat_interleave(K)[owned]
    assert torch.equal(got.q.view(torch.uint8)[row], x8.q.view(torch.uint8)[token])
    assert torch.equal(got.scale[row], x8.scale[token])
    free = torch.ones(N, dtype=torch.bool)
    free[row] = False
    free[int(ends_E[-1]) if rows is None and align == 1 else N :] = False  # the unwritten tail
    assert not got.q.view(torch.uint8)[free].any() and not got.scale[free].any()
    dx_ND = torch.randn(N, D)
    assert torch.equal(*(torch.autograd.grad(y, x_TD, dx_ND)[0] for y in (got.x, plain)))


@pytest.mark.parametrize(
    "T,K,E,D,align",
    [
        (1, 1, 1, 3, 1),  # one token, one expert
        (1, 8, 256, 5, 16),  # many experts, nearly all empty, padded
        (70, 2, 256, 7, 1),  # chunks of 64 tokens: the second one partial
        (300, 1, 3, 4, 4),  # k = 1: chunks of 128 tokens, the third partial
        (45, 3, 7, 9, 2),  # k = 3: 32-token chunks of 96 entries, in 128 lanes; T*K no multiple of it
        (21, 6, 11, 6, 4),  # k = 6: 16-token chunks of 96 entries
        (700, 2, 5, 2, 3),  # 11 chunks: the per-expert scan carries over steps (4 chunks in the interpreter)
        (1100, 4, 4096, 1, 1),  # the most experts: chunk counts in 16 expert tiles, a 4096-wide start scan
        (3, 3, 4, 1030, 2),  # rows wider than one column step: the weight gradient sums over steps
        (3, 128, 130, 2, 2),  # the largest top-k: one token a chunk
    ],
)
def test_permute_edge_shapes(T, K, E, D, align):
    check_permute(T, K, E, D, align, seed=T + K + E)


@pytest.mark.parametrize(
    "T,K,E,D,align,spare_rows",
    [
        (700, 2, 5, 2, 3, None),  # the scan carries over steps; default N (unrouted entries' rows spare)
        (45, 3, 7, 9, 1, 0),  # k = 3: 96 entries in 128 lanes; exactly the rows needed
        (3, 128, 130, 2, 2, 7),  # the largest top-k
    ],
)
def test_unrouted_entries_edge_shapes(T, K, E, D, align, spare_rows):
    check_permute(T, K, E, D, align, seed=T + K + E, unrouted=0.5, spare_rows=spare_rows)


def test_permute_fp16_matches_reference():
    check_permute(9, 3, 5, 17, 4, seed=1, dtype=torch.float16, tol=2e-3)


def test_empty_experts_get_empty_groups():
    ids_TK = torch.tensor([[3, 0], [3, 0], [0, 3]])
    x_TD = torch.arange(6.0).view(3, 2)
    x_ND, slots_TK, ends_E = moe_permute(x_TD, ids_TK, 5, align=4)
    assert ends_E.tolist() == [4, 4, 4, 8, 8]
    assert slots_TK.tolist() == [[4, 0], [5, 1], [2, 6]]
    assert x_ND.shape == (6 + 5 * 3, 2) and x_ND[[3, 7, 8]].abs().sum() == 0


def test_negative_ids_get_no_row_and_rows_fixes_n():
    ids_TK = torch.tensor([[3, -1], [-1, -1], [0, 3]])
    x_TD = torch.arange(1.0, 7.0).view(3, 2)
    x_ND, slots_TK, ends_E = moe_permute(x_TD, ids_TK, 5, align=4, rows=20)
    assert ends_E.tolist() == [4, 4, 4, 8, 8]
    assert slots_TK.tolist() == [[4, -1], [-1, -1], [0, 5]]
    assert x_ND.shape == (20, 2) and x_ND[[0, 4, 5]].tolist() == [[5, 6], [1, 2], [5, 6]]
    assert x_ND.abs().sum() == 5 + 6 + 1 + 2 + 5 + 6  # every other row zero


def test_opcheck():
    ids_TK = routing(6, 2, 5, seed=0)
    x_TD = torch.randn(6, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.pith.moe_permute, (x_TD, ids_TK, 5, 4, None))
    ids_TK = routing(6, 2, 5, seed=0, unrouted=0.3)  # then slots -1 in every op below
    torch.library.opcheck(torch.ops.pith.moe_permute, (x_TD, ids_TK, 5, 1, 11))
    x_ND, slots_TK, _ = moe_permute(x_TD, ids_TK, 5, 4, rows=30)
    y_ND = torch.randn(x_ND.shape, requires_grad=True)
    w_TK = torch.rand(6, 2, requires_grad=True)
    torch.library.opcheck(torch.ops.pith.moe_unpermute, (y_ND, slots_TK, w_TK))
    dout = torch.randn(6, 8)
    torch.library.opcheck(
        torch.ops.pith.moe_unpermute_backward, (dout, y_ND.detach(), slots_TK, w_TK.detach())
    )
    torch.library.opcheck(torch.ops.pith.moe_permute_backward, (y_ND.detach(), slots_TK))


def test_bad_inputs_raise_value_error():
    x_TD, ids_TK = torch.randn(4, 8), routing(4, 2, 6, seed=0)
    with pytest.raises(ValueError, match="x_TD: expected dtype"):
        moe_permute(x_TD.long(), ids_TK, 6)
    with pytest.raises(ValueError, match="expert_ids_TK: expected dtype"):
        moe_permute(x_TD, ids_TK.float(), 6)
    with pytest.raises(ValueError, match="expected 4 rows"):
        moe_permute(x_TD, ids_TK[:3], 6)
    with pytest.raises(ValueError, match="x_TD: expected 2 dimensions"):
        moe_permute(x_TD[None], ids_TK, 6)
    with pytest.raises(ValueError, match="contiguous"):
        moe_permute(x_TD.T, routing(8, 2, 6, seed=0), 6)
    with pytest.raises(ValueError, match="on cpu"):
        moe_permute(x_TD, ids_TK.to("meta"), 6)
    with pytest.raises(ValueError, match=r"expected ids < 4 \(< 0: no expert\), got 5"):
        moe_permute(x_TD, ids_TK, 4)
    one_unrouted = ids_TK.clone()
    one_unrouted[0, 0] = -1
    with pytest.raises(ValueError, match=r"rows: expected at least 7 \(routed entries plus padding\), got 6"):
        moe_permute(x_TD, one_unrouted, 6, rows=6)
    with pytest.raises(ValueError, match="rows: expected at least 14 .*, got 13"):
        moe_permute(x_TD, ids_TK, 6, align=2, rows=13)
    with pytest.raises(ValueError, match="align"):
        moe_permute(x_TD, ids_TK, 6, align=0)
    with pytest.raises(ValueError, match=r"expert_ids_TK: expected at most 128 columns \(top-k\), got 129"):
        moe_permute(x_TD, torch.zeros(4, 129, dtype=torch.long), 6)
    x8 = fp8_rows(x_TD)
    with pytest.raises(ValueError, match=r"expected x of q's shape \(4, 8\) .* got x \(4, 7\)"):
        moe_permute(x8._replace(x=x_TD[:, :7]), ids_TK, 6)
    with pytest.raises(ValueError, match="x_TD.q: expected dtype"):
        moe_permute(x8._replace(q=x_TD), ids_TK, 6)
    x_ND, slots_TK, _ = moe_permute(x_TD, ids_TK, 6)
    with pytest.raises(ValueError, match=r"weights_TK: expected shape \(4, 2\)"):
        moe_unpermute(x_ND, slots_TK, torch.rand(4, 3))
    with pytest.raises(ValueError, match="slots_TK: expected dtype"):
        moe_unpermute(x_ND, slots_TK.float(), torch.rand(4, 2))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,K,E,align,unrouted",
    [
        (4096, 8, 128, 1, 0.0),
        (4096, 8, 128, 16, 0.0),
        (20000, 8, 128, 128, 0.0),  # 1250 chunks: the per-expert scan carries over two steps of 1024
        (3000, 6, 4096, 4, 0.0),  # top-6 of the most experts
        (4096, 8, 16, 8, 0.6),  # EP's receiver: most entries on other ranks (id -1), a given rows
    ],
)
def test_bf16_on_gpu_at_model_scale(T, K, E, align, unrouted):
    D = 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    ids_TK = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    ids_TK[torch.rand(T, K, device="cuda", generator=g) < unrouted] = -1
    rows = int((ids_TK >= 0).sum()) + E * (align - 1) + 3 if unrouted else None
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    x_ND, slots_TK, ends_E = moe_permute(x_TD, ids_TK, E, align, rows=rows)
    ref_ND, ref_slots, ref_ends = moe_permute_reference(x_TD.detach(), ids_TK, E, align, rows=rows)
    assert torch.equal(x_ND, ref_ND) and torch.equal(slots_TK, ref_slots) and torch.equal(ends_E, ref_ends)
    w_TK = torch.rand(T, K, device="cuda", generator=g).requires_grad_()
    y_ND = torch.randn(x_ND.shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    out = moe_unpermute(y_ND, slots_TK, w_TK)
    y64, w64 = y_ND.detach().double().requires_grad_(), w_TK.detach().double().requires_grad_()
    ref = moe_unpermute_reference(y64, slots_TK, w64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    dout = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    dy, dw = torch.autograd.grad(out, (y_ND, w_TK), dout)
    ref_dy, ref_dw = torch.autograd.grad(ref, (y64, w64), dout.double())
    torch.testing.assert_close(dy.double(), ref_dy, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dw.double(), ref_dw, rtol=1e-3, atol=1e-3)
    (dx,) = torch.autograd.grad(x_ND, x_TD, y_ND.detach())
    ref_dx = torch.where(slots_TK[..., None] >= 0, y_ND.detach().double()[slots_TK], 0.0).sum(1)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=1e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_routing():
    """No host sync (capturable), and the launches' state (the scan's arrival counter) resets each replay."""
    T, K, E, D, align = 2048, 8, 128, 256, 16
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids_TK = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    moe_permute(x_TD, ids_TK, E, align)  # autotuning runs outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = moe_permute(x_TD, ids_TK, E, align)
    for _ in range(3):
        ids_TK.copy_(torch.rand(T, E, device="cuda").topk(K, dim=1).indices)
        graph.replay()
        for got, want in zip(outputs, moe_permute_reference(x_TD, ids_TK, E, align), strict=True):
            assert torch.equal(got, want)


def test_compiles_to_one_graph_with_gradients():
    ids_TK = routing(6, 2, 5, seed=3, unrouted=0.3)  # token 0 and others route to nothing
    x_TD = torch.randn(6, 8, requires_grad=True)
    w_TK = torch.rand(6, 2, requires_grad=True)
    routed_TK = (ids_TK >= 0).float()

    def roundtrip(x, w):
        x_ND, slots_TK, _ = moe_permute(x, ids_TK, 5, 4, rows=40)
        return moe_unpermute(x_ND * 2, slots_TK, w)

    out = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)(x_TD, w_TK)
    torch.testing.assert_close(out, 2 * x_TD * (w_TK * routed_TK).sum(1, keepdim=True))
    dx, dw = torch.autograd.grad(out.sum(), (x_TD, w_TK))
    torch.testing.assert_close(dx, 2 * (w_TK * routed_TK).sum(1, keepdim=True).expand(6, 8))
    torch.testing.assert_close(dw, 2 * x_TD.sum(1, keepdim=True) * routed_TK)


def test_no_tokens():
    x_TD = torch.randn(0, 4, requires_grad=True)
    x_ND, slots_TK, ends_E = moe_permute(x_TD, torch.zeros(0, 2, dtype=torch.long), 3, align=4)
    assert x_ND.shape == (9, 4) and (x_ND == 0).all()
    assert moe_permute(x_TD, torch.zeros(0, 2, dtype=torch.long), 3, rows=5)[0].equal(torch.zeros(5, 4))
    assert slots_TK.shape == (0, 2) and ends_E.tolist() == [0] * 3
    out = moe_unpermute(x_ND, slots_TK, torch.rand(0, 2))
    (dx,) = torch.autograd.grad(out.sum() + x_ND.sum(), x_TD)
    assert out.shape == (0, 4) and dx.shape == (0, 4)
