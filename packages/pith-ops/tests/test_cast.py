"""cast: torch's cast forward, the gradient cast back by the Triton kernel (interpreter on CPU)."""

import pith_ops._common
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import cast, drop_grad, grad, keep_grads, kept_copy

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


def test_a_trainable_weight_keeps_its_cast_until_it_changes():
    w = torch.nn.Parameter(torch.randn(64, 8))
    first = cast(w, torch.bfloat16)
    assert torch.equal(first, w.detach().bfloat16()) and kept_copy(w) is not None
    again = cast(w, torch.bfloat16)  # the next micro-batch: no new cast
    assert again.data_ptr() == first.data_ptr()
    dy = torch.randn(64, 8).bfloat16()
    (dw,) = torch.autograd.grad(again, w, dy)
    assert torch.equal(dw, dy.float())  # the gradient still reaches the fp32 master
    with torch.no_grad():
        w.add_(1.0)  # any in-place write (a checkpoint load, another optimizer) bumps the version
    assert kept_copy(w) is None
    fresh = cast(w, torch.bfloat16)
    assert fresh.data_ptr() != first.data_ptr() and torch.equal(fresh, w.detach().bfloat16())
    with torch.no_grad():
        w.add_(1.0)
        assert torch.equal(cast(w, torch.bfloat16), w.bfloat16()) and kept_copy(w) is None  # eval makes none
    x = torch.randn(64, 8, requires_grad=True) * 2  # not a leaf: an activation, never kept
    cast(x, torch.bfloat16)
    assert kept_copy(x) is None


def test_no_copies_are_kept_when_switched_off(monkeypatch):
    monkeypatch.setattr(pith_ops._common, "KEEP_COPIES", False)
    w = torch.nn.Parameter(torch.randn(4, 4))
    assert torch.equal(cast(w, torch.bfloat16), w.detach().bfloat16()) and kept_copy(w) is None


def test_a_marked_weight_gets_its_gradient_in_bf16_from_its_kept_cast():
    """keep_grads: the bf16 gradient held, not widened; a second backward adds in fp32 as .grad does;
    a gradient by another edge (a tied embedding) lands in .grad and grad() adds both."""
    w = torch.nn.Parameter(torch.randn(64, 8))
    plain = torch.nn.Parameter(w.detach().clone())
    keep_grads([w])
    gen = torch.Generator().manual_seed(0)
    dys = [torch.randn(64, 8, generator=gen).bfloat16() for _ in range(2)]
    cast(w, torch.bfloat16).backward(dys[0])
    cast(plain, torch.bfloat16).backward(dys[0])
    assert w.grad is None and grad(w).dtype == torch.bfloat16 and torch.equal(grad(w).float(), plain.grad)
    cast(w, torch.bfloat16).backward(dys[1])
    cast(plain, torch.bfloat16).backward(dys[1])
    assert grad(w).dtype == torch.float32 and torch.equal(grad(w), plain.grad)
    (w * 3.0).sum().backward()  # another edge: autograd's own accumulation into w.grad
    (plain * 3.0).sum().backward()
    assert torch.equal(grad(w), plain.grad) and torch.equal(w.grad, plain.grad)
    drop_grad(w)
    w.grad = None
    assert grad(w) is None
    cast(w, torch.bfloat16).backward(dys[0])  # after drop_grad: a fresh bf16 gradient
    assert torch.equal(grad(w), dys[0])
