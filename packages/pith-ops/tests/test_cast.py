"""cast: torch's cast forward, the gradient cast back by the Triton kernel (interpreter on CPU)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import cast

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    src=st.sampled_from(DTYPES),
    dst=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_values_and_gradient_equal_torch_cast(shape, src, dst, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 100).to(src).requires_grad_()
    y = cast(x, dst)
    dy = (torch.randn(shape, generator=gen) * 100).to(dst)
    (dx,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().clone().requires_grad_()
    y2 = x2.to(dst)
    (dx2,) = torch.autograd.grad(y2, x2, dy)
    assert y.dtype == dst and dx.dtype == src
    assert torch.equal(y, y2) and torch.equal(dx, dx2)


def test_non_contiguous_gradient_and_bad_dtype():
    x = torch.randn(6, 4, requires_grad=True)
    y = cast(x, torch.bfloat16)
    dy = torch.randn(4, 6).bfloat16().t()  # non-contiguous: torch's cast
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, dy.float())
    with pytest.raises(ValueError, match="dtype: expected one of"):
        cast(x, torch.int32)
