"""moe_permute / moe_unpermute against their float64 reference: outputs, every gradient, opcheck, errors.

Shape legend: T tokens, K top-k, D model dim, E experts, N grouped rows.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import moe_permute, moe_permute_reference, moe_unpermute, moe_unpermute_reference


def routing(T: int, K: int, E: int, seed: int, device="cpu") -> torch.Tensor:
    """Top-k style ids: K distinct experts per token (K <= E)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)


def check_permute(T, K, E, D, align, seed, dtype=torch.float32, device="cpu", tol=1e-5):
    g = torch.Generator().manual_seed(seed)
    ids_TK = routing(T, K, E, seed, device)
    x_TD = torch.randn(T, D, generator=g).to(device, dtype).requires_grad_()
    x_ND, slots_TK, ends_E = moe_permute(x_TD, ids_TK, E, align)
    x64 = x_TD.detach().double().requires_grad_()
    ref_ND, ref_slots, ref_ends = moe_permute_reference(x64, ids_TK, E, align)
    assert torch.equal(slots_TK, ref_slots) and torch.equal(ends_E, ref_ends)
    assert x_ND.shape == (T * K + E * (align - 1) if align > 1 else T * K, D)
    torch.testing.assert_close(x_ND.double(), ref_ND, rtol=0, atol=0)  # a permutation copies exactly

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
)
def test_permute_and_unpermute_match_reference_with_gradients(T, E_K, D, align, seed):
    E, K = E_K
    check_permute(T, K, E, D, align, seed)


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


def test_permute_fp16_matches_reference():
    check_permute(9, 3, 5, 17, 4, seed=1, dtype=torch.float16, tol=2e-3)


def test_empty_experts_get_empty_groups():
    ids_TK = torch.tensor([[3, 0], [3, 0], [0, 3]])
    x_TD = torch.arange(6.0).view(3, 2)
    x_ND, slots_TK, ends_E = moe_permute(x_TD, ids_TK, 5, align=4)
    assert ends_E.tolist() == [4, 4, 4, 8, 8]
    assert slots_TK.tolist() == [[4, 0], [5, 1], [2, 6]]
    assert x_ND.shape == (6 + 5 * 3, 2) and x_ND[[3, 7, 8]].abs().sum() == 0


def test_opcheck():
    ids_TK = routing(6, 2, 5, seed=0)
    x_TD = torch.randn(6, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.pith.moe_permute, (x_TD, ids_TK, 5, 4))
    x_ND, slots_TK, _ = moe_permute(x_TD, ids_TK, 5, 4)
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
    with pytest.raises(ValueError, match=r"ids in \[0, 4\), got ids in \[0, 5\]"):
        moe_permute(x_TD, ids_TK, 4)
    with pytest.raises(ValueError, match="align"):
        moe_permute(x_TD, ids_TK, 6, align=0)
    with pytest.raises(ValueError, match=r"expert_ids_TK: expected at most 128 columns \(top-k\), got 129"):
        moe_permute(x_TD, torch.zeros(4, 129, dtype=torch.long), 6)
    x_ND, slots_TK, _ = moe_permute(x_TD, ids_TK, 6)
    with pytest.raises(ValueError, match=r"weights_TK: expected shape \(4, 2\)"):
        moe_unpermute(x_ND, slots_TK, torch.rand(4, 3))
    with pytest.raises(ValueError, match="slots_TK: expected dtype"):
        moe_unpermute(x_ND, slots_TK.float(), torch.rand(4, 2))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,K,E,align",
    [
        (4096, 8, 128, 1),
        (4096, 8, 128, 16),
        (20000, 8, 128, 128),  # 1250 chunks: the per-expert scan carries over two steps of 1024
        (3000, 6, 4096, 4),  # top-6 of the most experts
    ],
)
def test_bf16_on_gpu_at_model_scale(T, K, E, align):
    D = 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    ids_TK = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    x_TD = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    x_ND, slots_TK, ends_E = moe_permute(x_TD, ids_TK, E, align)
    ref_ND, ref_slots, ref_ends = moe_permute_reference(x_TD.detach(), ids_TK, E, align)
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
    ref_dx = y_ND.detach().double()[slots_TK].sum(1)
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
    ids_TK = routing(6, 2, 5, seed=3)
    x_TD = torch.randn(6, 8, requires_grad=True)
    w_TK = torch.rand(6, 2, requires_grad=True)

    def roundtrip(x, w):
        x_ND, slots_TK, _ = moe_permute(x, ids_TK, 5, 4)
        return moe_unpermute(x_ND * 2, slots_TK, w)

    out = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)(x_TD, w_TK)
    torch.testing.assert_close(out, 2 * x_TD * w_TK.sum(1, keepdim=True))
    dx, dw = torch.autograd.grad(out.sum(), (x_TD, w_TK))
    torch.testing.assert_close(dx, 2 * w_TK.sum(1, keepdim=True).expand(6, 8))
    torch.testing.assert_close(dw, 2 * x_TD.sum(1, keepdim=True).expand(6, 2))


def test_no_tokens():
    x_TD = torch.randn(0, 4, requires_grad=True)
    x_ND, slots_TK, ends_E = moe_permute(x_TD, torch.zeros(0, 2, dtype=torch.long), 3, align=4)
    assert x_ND.shape == (9, 4) and (x_ND == 0).all()
    assert slots_TK.shape == (0, 2) and ends_E.tolist() == [0] * 3
    out = moe_unpermute(x_ND, slots_TK, torch.rand(0, 2))
    (dx,) = torch.autograd.grad(out.sum() + x_ND.sum(), x_TD)
    assert out.shape == (0, 4) and dx.shape == (0, 4)
