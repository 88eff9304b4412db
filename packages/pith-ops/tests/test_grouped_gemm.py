"""grouped_gemm against its float64 reference: output, dX, dW, opcheck, errors; its backward in
two halves (dX now, dW later) against the plain backward, bit for bit.

Shape legend: N grouped rows, I input features, O output features, E experts.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import _common, grouped_gemm, grouped_gemm_backward, grouped_gemm_reference


def check_grouped_gemm(sizes, tail, I, O, seed, dtype=torch.float32, device="cpu", tol=1e-4):
    """sizes: rows per expert; tail: extra rows past the last group (as moe_permute's padding leaves)."""
    g = torch.Generator().manual_seed(seed)
    E, N = len(sizes), sum(sizes) + tail
    ends_E = torch.tensor(sizes).cumsum(0).to(device, torch.int32)
    x_NI = torch.randn(N, I, generator=g).to(device, dtype).requires_grad_()
    w_EIO = (torch.randn(E, I, O, generator=g) / I**0.5).to(device, dtype).requires_grad_()
    y_NO = grouped_gemm(x_NI, w_EIO, ends_E)
    x64, w64 = x_NI.detach().double().requires_grad_(), w_EIO.detach().double().requires_grad_()
    ref = grouped_gemm_reference(x64, w64, ends_E)
    assert y_NO.dtype == dtype and y_NO.shape == (N, O)
    torch.testing.assert_close(y_NO.double(), ref, rtol=tol, atol=tol)
    assert (y_NO[sum(sizes) :] == 0).all()
    dy_NO = torch.randn(N, O, generator=g).to(device, dtype)
    dx, dw = torch.autograd.grad(y_NO, (x_NI, w_EIO), dy_NO)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x64, w64), dy_NO.double())
    torch.testing.assert_close(dx.double(), ref_dx, rtol=tol, atol=tol)
    torch.testing.assert_close(dw.double(), ref_dw, rtol=tol, atol=tol * max(sizes + [1]) ** 0.5)


@given(
    sizes=st.lists(st.integers(0, 21), min_size=1, max_size=6),
    tail=st.integers(0, 5),
    I=st.integers(1, 40),
    O=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_grouped_gemm_matches_reference_with_gradients(sizes, tail, I, O, seed):
    check_grouped_gemm(sizes, tail, I, O, seed)


@pytest.mark.parametrize(
    "sizes,tail",
    [
        ([1], 0),  # one token, one expert
        ([0, 0, 0], 4),  # every expert empty: output is all padding
        ([0] * 100 + [3] + [0] * 154 + [2], 1),  # 256 experts, nearly all empty
        ([40, 0, 17], 0),  # groups longer than a tile, not tile-aligned
    ],
)
def test_grouped_gemm_edge_shapes(sizes, tail):
    check_grouped_gemm(sizes, tail, I=9, O=12, seed=len(sizes))


def test_grouped_gemm_fp16_matches_reference():
    check_grouped_gemm([5, 0, 19, 8], 3, I=24, O=40, seed=0, dtype=torch.float16, tol=3e-3)


@given(
    sizes=st.lists(st.integers(0, 21), min_size=1, max_size=6),
    tail=st.integers(0, 5),
    I=st.integers(1, 24),
    O=st.integers(1, 24),
    seed=st.integers(0, 2**16),
    kernel=st.booleans(),
)
def test_grouped_gemm_backward_halves_equal_the_plain_backward_bit_for_bit(sizes, tail, I, O, seed, kernel):
    """kernel: the Triton kernels (interpreted on CPU), else the reference's autograd formulas."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_common, "INTERPRET", kernel)
        check_backward_halves(sizes, tail, I, O, seed)


def check_backward_halves(sizes, tail, I, O, seed):
    g = torch.Generator().manual_seed(seed)
    ends_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x_NI = torch.randn(sum(sizes) + tail, I, generator=g).requires_grad_()
    w_EIO = torch.randn(len(sizes), I, O, generator=g).requires_grad_()
    dy_NO = torch.randn(x_NI.shape[0], O, generator=g)
    want_dx, want_dw = torch.autograd.grad(grouped_gemm(x_NI, w_EIO, ends_E), (x_NI, w_EIO), dy_NO)
    dx, wgrad = grouped_gemm_backward(x_NI.detach(), w_EIO.detach(), ends_E, dy_NO)
    assert torch.equal(dx, want_dx) and torch.equal(wgrad(), want_dw)
    assert grouped_gemm_backward(x_NI.detach(), w_EIO.detach(), ends_E, dy_NO, need_dx=False)[0] is None


def test_opcheck():
    x_NI = torch.randn(13, 8, requires_grad=True)
    w_EIO = torch.randn(3, 8, 16, requires_grad=True)
    ends_E = torch.tensor([4, 4, 11], dtype=torch.int32)
    torch.library.opcheck(torch.ops.pith.grouped_gemm, (x_NI, w_EIO, ends_E))
    torch.library.opcheck(torch.ops.pith.grouped_gemm_wgrad, (x_NI.detach(), torch.randn(13, 16), ends_E, 3))


def test_bad_inputs_raise_value_error():
    x_NI, w_EIO, ends_E = torch.randn(6, 4), torch.randn(2, 4, 5), torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="w_EIO: expected dtype"):
        grouped_gemm(x_NI, w_EIO.double(), ends_E)
    with pytest.raises(ValueError, match="expected input size 4"):
        grouped_gemm(x_NI, torch.randn(2, 3, 5), ends_E)
    with pytest.raises(ValueError, match="expected 2 ends"):
        grouped_gemm(x_NI, w_EIO, ends_E[:1])
    with pytest.raises(ValueError, match="group_ends_E: expected dtype"):
        grouped_gemm(x_NI, w_EIO, ends_E.float())
    with pytest.raises(ValueError, match="x_NI: expected 2 dimensions"):
        grouped_gemm(x_NI[None], w_EIO, ends_E)
    with pytest.raises(ValueError, match="contiguous"):
        grouped_gemm(torch.randn(4, 6).T, w_EIO, ends_E)
    with pytest.raises(ValueError, match="on cpu"):
        grouped_gemm(x_NI, w_EIO, ends_E.to("meta"))


def moe_sizes(E: int, total: int, align: int, seed: int) -> list[int]:
    """Uneven per-expert row counts (some experts empty) rounded up to `align`, as moe_permute pads them."""
    g = torch.Generator().manual_seed(seed)
    share = torch.rand(E, generator=g) ** 3
    counts = (share / share.sum() * total).long()
    counts[torch.randperm(E, generator=g)[: E // 16]] = 0
    return ((counts + align - 1) // align * align).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("torch_mm", [True, False])
@pytest.mark.parametrize("align", [1, 16])
def test_bf16_on_gpu(torch_mm, align, monkeypatch):
    monkeypatch.setattr(_common, "USE_TORCH_GROUPED_MM", torch_mm)
    check_grouped_gemm(
        moe_sizes(32, 4096, align, seed=align),
        7,
        I=512,
        O=384,
        seed=0,
        dtype=torch.bfloat16,
        device="cuda",
        tol=3e-2,
    )


def test_compiles_to_one_graph_with_gradients():
    x_NI = torch.randn(13, 8, requires_grad=True)
    w_EIO = torch.randn(3, 8, 16, requires_grad=True)
    ends_E = torch.tensor([4, 4, 11], dtype=torch.int32)
    y = torch.compile(grouped_gemm, backend="aot_eager", fullgraph=True)(x_NI, w_EIO, ends_E)
    ref = grouped_gemm_reference(x_NI, w_EIO, ends_E)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    got, want = torch.autograd.grad(y.sum(), (x_NI, w_EIO)), torch.autograd.grad(ref.sum(), (x_NI, w_EIO))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
