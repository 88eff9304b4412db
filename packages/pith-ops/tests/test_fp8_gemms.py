"""fp8_linear and fp8_grouped_gemm against their float64 dequantise-then-matmul references (output and
both gradients), against the exact product, opcheck, compile, errors.

Tolerances: against the reference only the bf16 rounding of the GEMM output and fp32 (CUDA: fast)
accumulation differ: |op - ref| <= 2^-7 |ref| + 1% of ref's rms (5% on CUDA: see assert_matches), and
the norm of the difference is below 4e-3 of ref's. Against the exact float64 product
the e4m3 operands (3 mantissa bits, up to 2^-4 relative each) give a relative Frobenius error
measured at ~0.037 for Gaussian data; the bound is 0.06 (at sizes where the error averages out).

Shape legend: T rows, D input features, O output features; grouped: N rows, I input features, E experts.
"""

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_engine.fp8 import use_fp8
from pith_engine.layers import Linear, expert_gemm
from pith_models.qwen3_moe import Experts
from pith_ops import (
    FP8Rows,
    fp8_grouped_gemm,
    fp8_grouped_gemm_reference,
    fp8_linear,
    fp8_linear_reference,
    fp8_rows,
    grouped_gemm_reference,
    moe_permute,
    quantize_rows,
    swiglu,
    swiglu_fp8,
)
from pith_ops.fp8_grouped_gemm import fp8_grouped_gemm_weight
from pith_ops.fp8_linear import fp8_linear_weight


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    if not want.numel():
        return
    # CUDA's fast FP8 accumulation over K = 2048 left a few elements in a million off by up to 3.7% of
    # the rms (H200), the norm of the difference at 1.9e-3 relative; fp32 accumulation stays at 1e-2.
    atol = (5e-2 if got.is_cuda else 1e-2) * want.pow(2).mean().sqrt().item() + 1e-30
    torch.testing.assert_close(got.double(), want.to(got.device), rtol=2**-7, atol=atol)
    assert not want.any() or rel_error(got, want.to(got.device)) < 4e-3


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def check_linear(T, D, O, seed, device="cpu", dtype=torch.float32, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, T, D, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(O, D, generator=g) / D**0.5).to(device).requires_grad_()  # fp32 master weight
    y = fp8_linear(x, w)
    assert y.dtype == dtype and y.shape == (*lead, T, O)
    dy = torch.randn(y.shape, generator=g).to(device, dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert dx.dtype == dtype and dw.dtype == torch.float32
    ry, rdx, rdw = fp8_linear_reference(x.detach().reshape(-1, D), w.detach(), dy.reshape(-1, O))
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        assert_matches(got.reshape(want.shape), want)
    exact_x, exact_w, exact_dy = (
        x.detach().double().reshape(-1, D),
        w.detach().double(),
        dy.double().reshape(-1, O),
    )
    return rel_error(y.reshape(-1, O), exact_x @ exact_w.T), rel_error(dw, exact_dy.T @ exact_x)


@given(T=st.integers(1, 48), D=st.integers(1, 48), O=st.integers(1, 48), seed=st.integers(0, 2**16))
def test_fp8_linear_matches_reference_with_gradients(T, D, O, seed):
    check_linear(T, D, O, seed)


def test_leading_dims_bf16_empty_and_error_against_the_exact_product():
    assert max(check_linear(64, 128, 96, 0, dtype=torch.bfloat16, lead=(3,))) < 0.06
    check_linear(0, 32, 16, 1)  # no rows: empty output, zero weight gradient


def test_linear_module_switch_runs_fp8_with_bias():
    lin = Linear(32, 48)
    x = torch.randn(7, 32)
    plain = lin(x)
    use_fp8(lin)
    y = lin(x)
    assert lin.fp8 and rel_error(y, plain.double()) < 0.06
    torch.testing.assert_close(y, fp8_linear(x, lin.weight) + lin.bias)
    use_fp8(lin, False)
    assert torch.equal(lin(x), plain)


# opcheck's aot_dispatch test sums every output, and torch has no sum for fp8 (the saved operands);
# the compile test below runs the op through AOT autograd instead.
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")
FP8_INPUTS_TESTS = OPCHECK_TESTS[1:]  # test_schema multiplies the inputs: no mul for fp8 on CPU


def test_linear_opcheck():
    x, w = torch.randn(13, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    torch.library.opcheck(torch.ops.pith.fp8_linear_weight, (w.detach(),), test_utils=OPCHECK_TESTS)
    w8, x8 = fp8_linear_weight(w), quantize_rows(x.detach())
    torch.library.opcheck(torch.ops.pith.fp8_linear, (x, w, *w8, *x8), test_utils=FP8_INPUTS_TESTS)
    torch.library.opcheck(torch.ops.pith.fp8_linear_rows, (x.detach(),), test_utils=OPCHECK_TESTS)


def test_linear_compiles_to_one_graph_with_gradients():
    x, w = torch.randn(9, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    y = torch.compile(fp8_linear, backend="aot_eager", fullgraph=True)(x, w)
    want = fp8_linear(x, w)
    torch.testing.assert_close(y, want)
    got = torch.autograd.grad(y.sum(), (x, w))
    for a, b in zip(got, torch.autograd.grad(want.sum(), (x, w))):
        torch.testing.assert_close(a, b)


def test_projections_of_one_input_compile_to_one_quantisation(monkeypatch):
    """q, k and v projections of the same x under torch.compile: the rows op is one graph node after
    common-subexpression elimination, so the forward quantises x once (their backwards keep one copy);
    each backward quantises its own output gradient. Values and gradients as eager."""
    fp8_linear_module = sys.modules["pith_ops.fp8_linear"]
    calls = []
    counted = lambda x: calls.append(x.shape) or quantize_rows(x)  # noqa: E731
    monkeypatch.setattr(fp8_linear_module, "quantize_rows", counted)
    x = torch.randn(8, 4, 32, requires_grad=True)
    ws = [torch.randn(o, 32, requires_grad=True) for o in (64, 16, 16)]

    def qkv(x, *ws):
        return sum(fp8_linear(x, w).square().sum() * (i + 1) for i, w in enumerate(ws))

    y = torch.compile(qkv, backend="aot_eager", fullgraph=True)(x, *ws)
    assert calls == [(32, 32)]
    got = torch.autograd.grad(y, (x, *ws))
    assert len(calls) == 1 + 3
    want = qkv(x, *ws)
    torch.testing.assert_close(y, want)
    for a, b in zip(got, torch.autograd.grad(want, (x, *ws))):
        torch.testing.assert_close(a, b)


def test_linear_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="expected a last dimension of 8"):
        fp8_linear(torch.randn(3, 4), torch.randn(5, 8))
    with pytest.raises(ValueError, match="w_OD: expected 2 dimensions"):
        fp8_linear(torch.randn(3, 4), torch.randn(4))
    with pytest.raises(ValueError, match="expected dtype"):
        fp8_linear(torch.randn(3, 4), torch.randn(5, 4, dtype=torch.float64))


@pytest.mark.gpu
def test_linear_bf16_on_gpu():
    assert max(check_linear(4096, 2048, 1536, 0, device="cuda", dtype=torch.bfloat16, lead=(2,))) < 0.06
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(torch.randn(4, 24, device="cuda"), torch.randn(16, 24, device="cuda"))
    w = torch.randn(16, 32, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match="got 20 rows"):
        fp8_linear(torch.randn(20, 32, device="cuda"), w)
    with torch.no_grad():  # inference: any row count
        assert fp8_linear(torch.randn(20, 32, device="cuda"), w).shape == (20, 16)


def check_grouped(sizes, tail, I, O, seed, device="cpu", dtype=torch.float32):
    """sizes: rows per expert; tail: rows past the last group (moe_permute's unused padding)."""
    g = torch.Generator().manual_seed(seed)
    E, N = len(sizes), sum(sizes) + tail
    ends_E = torch.tensor(sizes).cumsum(0).to(device, torch.int32)
    x = torch.randn(N, I, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(E, I, O, generator=g) / I**0.5).to(device).requires_grad_()  # fp32 master weights
    y = fp8_grouped_gemm(x, w, ends_E)
    assert y.dtype == dtype and y.shape == (N, O) and (y[sum(sizes) :] == 0).all()
    dy = torch.randn(N, O, generator=g).to(device, dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert dx.dtype == dtype and dw.dtype == torch.float32 and (dx[sum(sizes) :] == 0).all()
    ry, rdx, rdw = fp8_grouped_gemm_reference(x.detach(), w.detach(), ends_E.cpu(), dy)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        assert_matches(got, want)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = grouped_gemm_reference(x64, w64, ends_E)
    exact_dw = torch.autograd.grad(exact, w64, dy.double())[0]
    return rel_error(y, exact), rel_error(dw, exact_dw)


@given(
    sizes=st.lists(st.integers(0, 21), min_size=1, max_size=6),
    tail=st.integers(0, 5),
    I=st.integers(1, 40),
    O=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_fp8_grouped_gemm_matches_reference_with_gradients(sizes, tail, I, O, seed):
    check_grouped(sizes, tail, I, O, seed)


@pytest.mark.parametrize(
    "sizes,tail",
    [
        ([1], 0),  # one token, one expert
        ([0, 0, 0], 4),  # every expert empty: output is all padding, dW all zero
        ([0] * 60 + [3] + [0] * 66 + [2], 1),  # 128 experts, nearly all empty
    ],
)
def test_grouped_edge_shapes(sizes, tail):
    check_grouped(sizes, tail, I=16, O=32, seed=len(sizes))


def test_grouped_bf16_rows_and_error_against_the_exact_product():
    assert max(check_grouped([96, 0, 160, 64], 16, I=128, O=96, seed=0, dtype=torch.bfloat16)) < 0.06


def test_experts_module_switch_runs_fp8():
    experts = Experts(3, 32, 16)
    torch.nn.init.normal_(experts.w_gate_up, std=0.2)
    torch.nn.init.normal_(experts.w_down, std=0.2)
    x_ND, ends_E = torch.randn(40, 32), torch.tensor([16, 16, 32], dtype=torch.int32)
    plain = experts(x_ND, ends_E)
    use_fp8(experts)
    y = experts(x_ND, ends_E)
    assert experts.fp8 and rel_error(y, plain.double()) < 0.1 and not torch.equal(y, plain)


def test_grouped_with_precomputed_operands_equals_the_plain_call():
    """w8 (a cached weight quantisation) and x8 (rows quantised by the pass writing x: swiglu_fp8)
    change nothing but where the quantisation ran: output and gradients bit for bit."""
    h = torch.randn(13, 32, requires_grad=True)
    w = torch.randn(3, 16, 24, requires_grad=True)
    ends_E = torch.tensor([4, 4, 11], dtype=torch.int32)
    x, *x8 = swiglu_fp8(h)
    got = fp8_grouped_gemm(x, w, ends_E, fp8_grouped_gemm_weight(w), x8)
    want = fp8_grouped_gemm(swiglu(h), w, ends_E)
    dy = torch.randn_like(want)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (h, w), dy), torch.autograd.grad(want, (h, w), dy)):
        assert torch.equal(a, b)


def check_experts_on_fp8_rows(T, K, E, D, F, device="cpu", dtype=torch.float32):
    """Rows permuted in FP8 (quantised once per token, pith_ops.FP8Rows, as stage 2 sends them to FP8
    experts) against the rows permuted then quantised by the expert GEMM: the same e4m3 rows, so
    output and gradients bit for bit, through a stand-in x of no memory."""
    experts = Experts(E, D, F).to(device)
    torch.nn.init.normal_(experts.w_gate_up, std=D**-0.5)
    torch.nn.init.normal_(experts.w_down, std=F**-0.5)
    use_fp8(experts)
    g = torch.Generator(device).manual_seed(0)
    x_TD = torch.randn(T, D, device=device, generator=g, dtype=dtype).requires_grad_()
    ids_TK = torch.rand(T, E, device=device, generator=g).topk(K, dim=1).indices
    leaves = (x_TD, experts.w_gate_up, experts.w_down)
    runs, kinds = [], []
    for rows in (fp8_rows(x_TD), x_TD):
        x_ND, _, ends_E = moe_permute(rows, ids_TK, E, align=16)
        kinds.append(type(x_ND))
        y = experts(x_ND, ends_E)
        runs.append([y, *torch.autograd.grad(y, leaves, torch.ones_like(y))])
    assert kinds == [FP8Rows, torch.Tensor] and runs[0][0].abs().sum() > 0
    for got, want in zip(*runs):
        assert torch.equal(got, want)


def test_experts_on_rows_dispatched_in_fp8_equal_the_plain_rows():
    check_experts_on_fp8_rows(T=12, K=2, E=3, D=32, F=16)
    rows, _, ends_E = moe_permute(fp8_rows(torch.randn(4, 16)), torch.tensor([[0], [1], [1], [0]]), 2)
    with pytest.raises(ValueError, match=r"FP8Rows\) need fp8=True"):  # a bf16 GEMM would read zeros
        expert_gemm(rows, torch.randn(2, 16, 8), ends_E, fp8=False)


@pytest.mark.gpu
def test_experts_on_rows_dispatched_in_fp8_on_gpu():
    check_experts_on_fp8_rows(T=4096, K=8, E=32, D=2048, F=768, device="cuda", dtype=torch.bfloat16)


def test_grouped_opcheck():
    x, w = torch.randn(13, 16, requires_grad=True), torch.randn(3, 16, 32, requires_grad=True)
    ends_E = torch.tensor([4, 4, 11], dtype=torch.int32)
    torch.library.opcheck(torch.ops.pith.fp8_grouped_gemm_weight, (w.detach(),), test_utils=OPCHECK_TESTS)
    args = (x, w, *fp8_grouped_gemm_weight(w), ends_E)
    torch.library.opcheck(torch.ops.pith.fp8_grouped_gemm, args, test_utils=FP8_INPUTS_TESTS)


def test_grouped_compiles_to_one_graph_with_gradients():
    x, w = torch.randn(13, 16, requires_grad=True), torch.randn(3, 16, 32, requires_grad=True)
    ends_E = torch.tensor([4, 4, 11], dtype=torch.int32)
    y = torch.compile(fp8_grouped_gemm, backend="aot_eager", fullgraph=True)(x, w, ends_E)
    want = fp8_grouped_gemm(x, w, ends_E)
    torch.testing.assert_close(y, want)
    for a, b in zip(torch.autograd.grad(y.sum(), (x, w)), torch.autograd.grad(want.sum(), (x, w))):
        torch.testing.assert_close(a, b)


def test_grouped_bad_inputs_raise_value_error():
    x, w, ends_E = torch.randn(6, 4), torch.randn(2, 4, 5), torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="x_NI's columns"):
        fp8_grouped_gemm(x, torch.randn(2, 3, 5), ends_E)
    with pytest.raises(ValueError, match="one group end per expert"):
        fp8_grouped_gemm(x, w, ends_E[:1])
    with pytest.raises(ValueError, match="w_EIO: expected 3 dimensions"):
        fp8_grouped_gemm(x, w[0], ends_E)


@pytest.mark.gpu
def test_grouped_bf16_on_gpu():
    """The Qwen3-30B-A3B gate_up shape over 32 experts, 16-row groups (two empty), a padding tail."""
    g = torch.Generator().manual_seed(0)
    sizes = (torch.randint(0, 40, (32,), generator=g) * 16).tolist()
    sizes[3] = sizes[17] = 0
    assert max(check_grouped(sizes, 48, I=2048, O=1536, seed=0, device="cuda", dtype=torch.bfloat16)) < 0.06
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_grouped_gemm(
            torch.randn(4, 24, device="cuda"),
            torch.randn(1, 24, 16, device="cuda"),
            torch.tensor([4], device="cuda"),
        )
