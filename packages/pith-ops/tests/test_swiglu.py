"""swiglu / swiglu_oss: Triton kernels (interpreter on CPU) against the float64 reference; swiglu_fp8
against swiglu then quantize_rows' reference."""

import pith_ops._common
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops.fp8_quant import FP8, quantize_rows_reference
from pith_ops.swiglu import (
    _forward_fp8,
    _swiglu_backward_op,
    _swiglu_fp8_op,
    _swiglu_op,
    swiglu,
    swiglu_fp8,
    swiglu_oss,
    swiglu_oss_reference,
    swiglu_reference,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
OPS = {"swiglu": (swiglu, swiglu_reference), "swiglu_oss": (swiglu_oss, swiglu_oss_reference)}


def assert_matches_float64(name, x, scale=1.0):
    """Output and dx of the op vs the reference run in float64 on the same (rounded) input."""
    op, reference = OPS[name]
    x = x.detach().requires_grad_()
    y = op(x)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = reference(x64)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    tol = TOL[x.dtype]
    assert y.dtype == x.dtype and y.shape == y64.shape and dx.shape == x.shape
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(dx.double(), dx64, rtol=tol, atol=tol * scale)


@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=2),
    F=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    name=st.sampled_from(sorted(OPS)),
    scale=st.sampled_from([1.0, 6.0]),
    seed=st.integers(0, 2**16),
)
def test_output_and_gradient_match_float64_reference(lead, F, dtype, name, scale, seed):
    # scale 6 pushes many GPT-OSS inputs past the clamp limit of 7, exercising the zeroed gradients.
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, 2 * F, generator=g) * scale).to(dtype)
    assert_matches_float64(name, x, scale)


def test_one_token_and_empty_batch():
    assert_matches_float64("swiglu", torch.randn(1, 6))
    assert_matches_float64("swiglu_oss", torch.randn(6) * 8)
    assert swiglu(torch.randn(0, 3, 8)).shape == (0, 3, 4)


def test_clamp_saturation_zeroes_gradient():
    # gate above the limit: constant in gate; |up| above the limit: constant in up.
    x = torch.tensor([[9.0, 0.5, 1.0, -8.0, 1.0, 8.0]], requires_grad=True)
    swiglu_oss(x).sum().backward()
    dgate, dup = x.grad[0, ::2], x.grad[0, 1::2]
    assert dgate[0] == 0 and dup[1] == 0 and dup[2] == 0
    assert dgate[1] != 0 and dgate[2] != 0 and dup[0] != 0


def test_non_contiguous_input_is_handled():
    x = torch.randn(10, 6).t()  # [6, 10], column-major
    assert not x.is_contiguous()
    assert_matches_float64("swiglu", x)
    assert_matches_float64("swiglu_oss", torch.randn(4, 3, 12)[:, :, 2:] * 5)


def test_cpu_fallback_without_interpreter_matches_reference(monkeypatch):
    monkeypatch.setattr(pith_ops._common, "INTERPRET", False)
    assert_matches_float64("swiglu", torch.randn(3, 10))
    assert_matches_float64("swiglu_oss", torch.randn(3, 10) * 6)


@pytest.mark.parametrize("oss", [False, True])
def test_opcheck(oss):
    x = torch.randn(3, 10) * 5
    torch.library.opcheck(_swiglu_op, (x.requires_grad_(), oss, 1.702, 7.0))
    torch.library.opcheck(_swiglu_backward_op, (torch.randn(3, 5), x.detach(), oss, 1.702, 7.0))


def test_compiles_to_one_graph():
    x = torch.randn(4, 8, requires_grad=True)
    f = torch.compile(lambda t: swiglu(t) + swiglu_oss(t), fullgraph=True, backend="aot_eager")
    y = f(x)
    torch.testing.assert_close(y, swiglu_reference(x) + swiglu_oss_reference(x))
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.randn(4, 7), "last dimension 2F"),
        (torch.randn(4, 0), "last dimension 2F"),
        (torch.tensor(1.0), "last dimension 2F"),
        (torch.ones(4, 8, dtype=torch.int32), "dtype"),
        ([1.0, 2.0], "torch.Tensor"),
    ],
)
def test_bad_input_raises_value_error(x, match):
    for op in (swiglu, swiglu_oss):
        with pytest.raises(ValueError, match=match):
            op(x)


def test_bad_limit_raises_value_error():
    with pytest.raises(ValueError, match="limit"):
        swiglu_oss(torch.randn(2, 4), limit=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("shape", [(1, 2), (3, 5, 2 * 777), (4096, 2 * 768)])
def test_bf16_on_gpu_matches_float64_reference(name, shape):
    x = (torch.randn(shape, device="cuda") * 4).bfloat16()
    assert_matches_float64(name, x, scale=4.0)
    f = torch.compile(OPS[name][0], fullgraph=True)
    torch.testing.assert_close(f(x), OPS[name][0](x), rtol=0, atol=0)


def check_swiglu_fp8(x_N2F: torch.Tensor) -> None:
    """swiglu_fp8 against its definition: y is swiglu's (bit for bit, and its gradient), the e4m3 rows
    and scales are quantize_rows_reference(y)'s bit for bit (the kernel's fp32 quotients too), and they
    round-trip to y in float64 within half an e4m3 step (the scales are powers of two)."""
    x = x_N2F.detach().requires_grad_()
    y, y8, scale = swiglu_fp8(x)
    want = swiglu(x)
    assert torch.equal(y, want) and y8.dtype == FP8 and scale.dtype == torch.float32
    ref_q, ref_scale = quantize_rows_reference(want.detach())
    assert torch.equal(scale, ref_scale) and torch.equal(y8.view(torch.uint8), ref_q.view(torch.uint8))
    if x.is_cuda:
        q32 = _forward_fp8(x.detach(), torch.float32)[1]
        assert torch.equal(q32, quantize_rows_reference(want.detach(), torch.float32)[0])
    deq, y64 = y8.double() * scale.double()[:, None], y.detach().double()
    assert ((deq - y64).abs() <= torch.maximum(y64.abs() * 2**-4, scale.double()[:, None] * 2**-10)).all()
    dy = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(want, x, dy)[0])


@given(
    N=st.integers(0, 12),
    F=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_swiglu_fp8_is_swiglu_then_quantize_rows(N, F, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 2 * F, generator=g) * torch.exp2(torch.randint(-12, 13, (N, 1), generator=g))
    check_swiglu_fp8(x.to(dtype))
    q32 = _forward_fp8(x.to(dtype), torch.float32)[1]  # the interpreted kernel's quotients
    assert torch.equal(q32, quantize_rows_reference(swiglu(x.to(dtype)), torch.float32)[0])


def test_swiglu_fp8_opcheck_compile_and_errors():
    x = torch.randn(5, 2 * 24, requires_grad=True)
    torch.library.opcheck(_swiglu_fp8_op, (x,), test_utils=("test_autograd_registration", "test_faketensor"))
    y, y8, scale = torch.compile(swiglu_fp8, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(y, swiglu(x)) and torch.equal(y8.view(torch.uint8), swiglu_fp8(x)[1].view(torch.uint8))
    with pytest.raises(ValueError, match="expected 2 dimensions"):
        swiglu_fp8(torch.randn(2, 3, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_fp8_bit_exact_on_gpu(dtype):
    """The compiled kernel's e4m3 casts (the interpreter's are wrong for some values)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4099, 2 * 768, generator=g) * torch.exp2(torch.randint(-12, 13, (4099, 1), generator=g))
    check_swiglu_fp8(x.to("cuda", dtype))
