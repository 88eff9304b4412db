"""apply_rope: Triton kernel (interpreter on CPU) against the float64 reference, forward and dx."""

import pith_ops._common
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops.rope import _rope_op, apply_rope, apply_rope_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def angles(B, S, R, dtype=torch.float32, device="cpu"):
    """cos/sin of real rotary angles, position * inverse frequency, [B, S, R]."""
    pos = (
        torch.arange(S, device=device, dtype=torch.float64)[:, None]
        + torch.arange(B, device=device)[:, None, None]
    )
    theta = pos * 10000.0 ** (-torch.arange(R, device=device) / max(R, 1))
    return theta.cos().to(dtype), theta.sin().to(dtype)


def assert_matches_float64(x, cos, sin, interleaved):
    """Output and dx vs the reference run in float64 on the same (rounded) inputs."""
    x = x.detach().requires_grad_()
    y = apply_rope(x, cos, sin, interleaved)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = apply_rope_reference(x64, cos.double(), sin.double(), interleaved)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert y.dtype == x.dtype and y.shape == x.shape and dx.shape == x.shape
    tol = TOL[x.dtype]
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
    torch.testing.assert_close(dx.double(), dx64, rtol=tol, atol=tol)


@given(
    B=st.integers(1, 2),
    S=st.integers(1, 5),
    H=st.integers(1, 5),
    R=st.integers(1, 9),
    rest=st.integers(0, 6),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    cs_dtype=st.sampled_from([torch.float32, torch.float16]),
    interleaved=st.booleans(),
    shared_batch=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_output_and_gradient_match_float64_reference(
    B, S, H, R, rest, dtype, cs_dtype, interleaved, shared_batch, seed
):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, 2 * R + rest, generator=g).to(dtype)
    cos, sin = angles(1 if shared_batch else B, S, R, cs_dtype)
    assert_matches_float64(x, cos, sin, interleaved)


def test_strided_views_are_read_in_place():
    # q sliced out of a fused qkv projection, and cos/sin expanded over the batch (stride 0).
    qkv = torch.randn(2, 3, 6 * 8)
    q = qkv[..., : 4 * 8].view(2, 3, 4, 8)
    cos, sin = angles(1, 3, 4)
    for interleaved in (False, True):
        assert_matches_float64(q, cos.expand(2, 3, 4), sin.expand(2, 3, 4), interleaved)
    assert_matches_float64(torch.randn(2, 8, 3, 5).transpose(1, 3), *angles(2, 5, 2), True)
    assert_matches_float64(torch.randn(1, 2, 2, 12)[..., ::2], *angles(1, 2, 3), False)


def test_cpu_fallback_without_interpreter_matches_reference(monkeypatch):
    monkeypatch.setattr(pith_ops._common, "INTERPRET", False)
    assert_matches_float64(torch.randn(2, 3, 2, 10), *angles(2, 3, 4), True)


def test_opcheck():
    x = torch.randn(2, 3, 2, 10, requires_grad=True)
    cos, sin = angles(2, 3, 4)
    for interleaved in (False, True):
        torch.library.opcheck(_rope_op, (x, cos, sin, interleaved, False))


def test_compiles_to_one_graph():
    x = torch.randn(1, 3, 2, 8, requires_grad=True)
    cos, sin = angles(1, 3, 4)
    y = torch.compile(apply_rope, fullgraph=True, backend="aot_eager")(x, cos, sin)
    torch.testing.assert_close(y, apply_rope_reference(x, cos, sin))
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize(
    "x, cs_shape, match",
    [
        (torch.randn(2, 3, 8), (2, 3, 4), "4 dimensions"),
        (torch.randn(2, 3, 1, 8), (2, 3, 5), "2R <= 8"),
        (torch.randn(2, 3, 1, 8), (2, 4, 4), r"\(2 or 1, 3, R\)"),
        (torch.randn(2, 3, 1, 8), (3, 3, 4), r"\(2 or 1, 3, R\)"),
        (torch.randn(2, 3, 1, 8), (2, 3, 0), "0 < 2R"),
        (torch.ones(2, 3, 1, 8, dtype=torch.int32), (2, 3, 4), "dtype"),
    ],
)
def test_bad_input_raises_value_error(x, cs_shape, match):
    with pytest.raises(ValueError, match=match):
        apply_rope(x, torch.ones(cs_shape), torch.ones(cs_shape))


def test_mismatched_sin_or_device_raises_value_error():
    x, cos = torch.randn(1, 2, 1, 8), torch.ones(1, 2, 4)
    with pytest.raises(ValueError, match="equal shapes"):
        apply_rope(x, cos, torch.ones(1, 2, 3))
    with pytest.raises(ValueError, match="on cpu"):
        apply_rope(x, cos, torch.ones(1, 2, 4, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape, R", [((1, 1, 1, 64), 16), ((2, 77, 5, 96), 24), ((2, 512, 32, 128), 64)])
def test_bf16_on_gpu_matches_float64_reference(shape, R, interleaved):
    x = torch.randn(shape, device="cuda").bfloat16()
    cos, sin = angles(1, shape[1], R, torch.float32, "cuda")
    assert_matches_float64(x, cos, sin, interleaved)
    f = torch.compile(apply_rope, fullgraph=True)
    torch.testing.assert_close(
        f(x, cos, sin, interleaved), apply_rope(x, cos, sin, interleaved), rtol=0, atol=0
    )
