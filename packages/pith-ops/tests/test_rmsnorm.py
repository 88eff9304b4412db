"""rms_norm: Triton kernels (interpreter on CPU) against the float64 reference, dx and dweight."""

import pith_ops._common
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops.rmsnorm import (
    _rms_norm_backward_op,
    _rms_norm_op,
    _sum_partials_kernel,
    rms_norm,
    rms_norm_reference,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_matches_float64(x, w, eps=1e-6):
    """Output, dx and dweight vs the reference run in float64 on the same (rounded) inputs."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = rms_norm(x, w, eps)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = rms_norm_reference(x64, w64, eps)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    assert (y.dtype, dx.dtype, dw.dtype) == (x.dtype, x.dtype, w.dtype)
    tol, wtol = TOL[x.dtype], TOL[w.dtype]
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
    torch.testing.assert_close(dx.double(), dx64, rtol=tol, atol=tol)
    # dweight sums over all rows: allow the accumulated rounding of that many terms.
    rows = max(1, x.numel() // x.shape[-1])
    torch.testing.assert_close(dw.double(), dw64, rtol=max(tol, wtol), atol=max(tol, wtol) * rows**0.5)


@given(
    lead=st.lists(st.integers(1, 6), min_size=1, max_size=2),
    D=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    w_fp32=st.booleans(),
    scale=st.sampled_from([1e-2, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_output_and_gradients_match_float64_reference(lead, D, dtype, w_fp32, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, D, generator=g) * scale).to(dtype)
    w = (torch.randn(D, generator=g) * 0.5 + 1.0).to(torch.float32 if w_fp32 else dtype)
    assert_matches_float64(x, w, 1e-5)


def test_one_token_many_rows_and_empty_batch():
    assert_matches_float64(torch.randn(1, 33), torch.randn(33))
    # 9 tiles of 8 rows (the last partial) over 2 backward programs on CPU: each program
    # accumulates dweight over several tiles.
    assert_matches_float64(torch.randn(70, 300), torch.randn(300))
    assert rms_norm(torch.randn(0, 4, 8), torch.ones(8), 1e-6).shape == (0, 4, 8)


def test_dweight_partials_sum_over_more_programs_than_one_block():
    # On the GPU P is 2-4 per SM (264-528 rows); CPU runs have P <= 2, so test the finishing kernel
    # alone: 300 partial rows (three blocks of 128, the last partial) over 45 columns (two programs).
    partial_PD = torch.randn(300, 45, dtype=torch.float64).float()
    dw_D = torch.empty(45, dtype=torch.float16)
    _sum_partials_kernel[(2,)](partial_PD, dw_D, 300, 45, BLOCK_P=128, BLOCK_C=32)
    torch.testing.assert_close(dw_D.double(), partial_PD.double().sum(0), rtol=1e-3, atol=1e-2)


def test_non_contiguous_input_is_handled():
    assert_matches_float64(torch.randn(12, 5).t(), torch.randn(12))
    assert_matches_float64(torch.randn(4, 20)[:, 3:], torch.randn(40)[::2][:17])


def test_cpu_fallback_without_interpreter_matches_reference(monkeypatch):
    monkeypatch.setattr(pith_ops._common, "INTERPRET", False)
    assert_matches_float64(torch.randn(3, 10), torch.randn(10))


def test_opcheck():
    x, w = torch.randn(5, 24).requires_grad_(), torch.randn(24).requires_grad_()
    torch.library.opcheck(_rms_norm_op, (x, w, 1e-6))
    torch.library.opcheck(_rms_norm_backward_op, (torch.randn(5, 24), x.detach(), w.detach(), 1e-6))


def test_compiles_to_one_graph():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    y = torch.compile(rms_norm, fullgraph=True, backend="aot_eager")(x, w, 1e-6)
    torch.testing.assert_close(y, rms_norm_reference(x, w, 1e-6))
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize(
    "x, w, eps, match",
    [
        (torch.randn(4, 8), torch.randn(7), 1e-6, "matching the last dim"),
        (torch.randn(4, 8), torch.randn(8, 1), 1e-6, "dimensions"),
        (torch.randn(4, 0), torch.randn(0), 1e-6, "non-empty"),
        (torch.tensor(1.0), torch.randn(1), 1e-6, "matching the last dim"),
        (torch.ones(4, 8, dtype=torch.int64), torch.randn(8), 1e-6, "dtype"),
        (torch.randn(4, 8), torch.ones(8, dtype=torch.int32), 1e-6, "dtype"),
        (torch.randn(4, 8), torch.randn(8, device="meta"), 1e-6, "on cpu"),
        (torch.randn(4, 8), torch.randn(8), -1.0, "eps"),
        (torch.randn(4, 8), torch.randn(8), 0.0, "eps"),
    ],
)
def test_bad_input_raises_value_error(x, w, eps, match):
    with pytest.raises(ValueError, match=match):
        rms_norm(x, w, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 1000), (4096, 2048), (2, 300, 4, 128)])
def test_bf16_on_gpu_matches_float64_reference(shape):
    x = torch.randn(shape, device="cuda").bfloat16() * 3
    w = (torch.randn(shape[-1], device="cuda") * 0.2 + 1.0).bfloat16()
    assert_matches_float64(x, w, 1e-6)
    f = torch.compile(rms_norm, fullgraph=True)
    torch.testing.assert_close(f(x, w, 1e-6), rms_norm(x, w, 1e-6), rtol=0, atol=0)
