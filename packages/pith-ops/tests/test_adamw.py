"""adamw_ (Triton under the interpreter on CPU) and adamw_reference_ against the path they replace:
the gradients scaled in place by parallel.clip_coef, then torch.optim.AdamW (fp32, CPU)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import (
    adamw_,
    adamw_reference_,
    cast,
    keep,
    kept_copy,
    quantize_weight,
    quantize_weight_reference,
)
from pith_ops.fp8_quant import FP8, weight_amax


def torch_path(p0, grads, scale, lr, betas, wd, eps):
    """Steps of the previous path: the gradient scaled in place, then torch's AdamW (single-tensor)."""
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for g in grads:
        p.grad = g.clone()
        torch._foreach_mul_([p.grad], scale.reshape(()))
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def ours(fn, p0, grads, scale, lr, betas, wd, eps, dtype=torch.float32):
    p, m, v = p0.clone().to(dtype), torch.zeros_like(p0, dtype=dtype), torch.zeros_like(p0, dtype=dtype)
    for step, g in enumerate(grads, 1):
        fn(p, g.to(dtype), m, v, scale.to(dtype), lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=wd,
           eps=eps, step=step)  # fmt: skip
    return p, m, v


@given(
    n=st.integers(1, 9000),
    steps=st.integers(1, 4),
    scale=st.floats(0.01, 2.0),
    lr=st.floats(1e-4, 1e-1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.999),
    wd=st.sampled_from([0.0, 0.1]),
    eps=st.sampled_from([1e-8, 1e-6]),
    seed=st.integers(0, 2**16),
)
def test_matches_the_clip_then_torch_adamw_path(n, steps, scale, lr, beta1, beta2, wd, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [
        torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-4, 1, generator=gen)
        for _ in range(steps)
    ]
    scale_t = torch.tensor([scale])
    args = (scale_t, lr, (beta1, beta2), wd, eps)
    want = torch_path(p0, grads, *args)
    # The reference is the previous path's arithmetic, bit for bit.
    for got, w in zip(ours(adamw_reference_, p0, grads, *args), want):
        assert torch.equal(got, w)
    # The kernel: fp32 against it to a few ulps of the update (fma contraction, the interpreter's
    # rounding), and both at fp32 rounding from the same steps in float64.
    kernel = ours(adamw_, p0, grads, *args)
    exact = ours(adamw_reference_, p0.double(), [g.double() for g in grads], *args, dtype=torch.float64)
    change = (want[0] - p0).abs().max().item()
    for got, w, x in zip(kernel, want, exact):
        tol = 4e-7 * w.abs().max().item() + 1e-3 * change
        assert (got - w).abs().max().item() <= tol
        assert (got.double() - x).abs().max().item() <= tol + (w.double() - x).abs().max().item()


@pytest.mark.parametrize("fn", [adamw_, adamw_reference_])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_scale_writes_nothing(fn, bad):
    p, g = torch.randn(5000), torch.randn(5000)
    m, v = torch.randn(5000), torch.rand(5000)
    before = [t.clone() for t in (p, m, v)]
    fn(p, g, m, v, torch.tensor([bad]), lr=0.1, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, step=3)
    assert all(torch.equal(t, b) for t, b in zip((p, m, v), before))
    fn(p, g, m, v, torch.tensor([1.0]), lr=0.1, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, step=3)
    assert not torch.equal(p, before[0])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(g=torch.zeros(3)), "g: expected the parameter's shape"),
        (dict(m=torch.zeros(4, dtype=torch.float64)), "m: expected dtype"),
        (dict(v=torch.zeros(8)[::2]), "v: expected a contiguous tensor"),
        (dict(scale=torch.ones(2)), "one-element scale"),
        (dict(step=0), "step >= 1"),
        (dict(copy=torch.zeros(5, dtype=torch.bfloat16)), "copy: expected the parameter's shape"),
    ],
)
def test_bad_input_is_a_value_error_before_any_write(change, match):
    args = dict(
        p=torch.ones(4),
        g=torch.ones(4),
        m=torch.zeros(4),
        v=torch.zeros(4),
        scale=torch.ones(1),
        step=1,
        copy=None,
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        adamw_(**{k: args[k] for k in "pgmv"}, scale=args["scale"], lr=0.1, beta1=0.9, beta2=0.95,
               weight_decay=0.0, eps=1e-8, step=args["step"], copy=args["copy"])  # fmt: skip
    assert torch.equal(args["p"], torch.ones(4)) or "p" in change


@pytest.mark.parametrize("fn", [adamw_, adamw_reference_])
def test_the_copy_is_the_new_parameter_cast_bit_for_bit_and_kept(fn):
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    # Magnitudes over the exponent range, fp32 subnormals included: the kernel rounds on the bits.
    p = torch.randn(9000, generator=gen) * 10 ** torch.empty(9000).uniform_(-40, 30, generator=gen)
    p.requires_grad_()
    m, v = torch.zeros(9000), torch.zeros(9000)
    cast(p, dtype)  # keeps the copy the update will rewrite
    for step in (1, 2):
        copy, g = kept_copy(p), torch.randn(9000, generator=gen)
        with torch.no_grad():
            fn(p, g, m, v, torch.tensor([0.5]), lr=0.1, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
               step=step, copy=copy)  # fmt: skip
        assert kept_copy(p) is copy and torch.equal(copy, p.detach().to(dtype))
    before = copy.clone()
    with torch.no_grad():
        fn(p, g, m, v, torch.tensor([math.nan]), lr=0.1, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
           step=3, copy=copy)  # fmt: skip
    assert torch.equal(copy, before) and torch.equal(copy, p.detach().to(dtype))


@given(n=st.integers(1, 9000), steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_bf16_gradient_updates_exactly_as_its_widened_copy(n, steps, seed):
    # pith_ops.cast's kept gradients reach the update in bf16: every bf16 value is an fp32 one.
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 3).bfloat16() for _ in range(steps)]
    args = (torch.tensor([0.7]), 1e-2, (0.9, 0.95), 0.1, 1e-8)
    for fn in (adamw_, adamw_reference_):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        for step, g in enumerate(grads, 1):
            fn(p, g, m, v, args[0], lr=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, step=step)
        want = ours(fn, p0, [g.float() for g in grads], *args)
        assert all(torch.equal(a, b) for a, b in zip((p, m, v), want))


@given(
    shape=st.sampled_from([(40, 50), (3, 20, 24), (1, 1, 5), (2, 33, 70)]),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_fp8_copies_are_the_new_parameter_quantised_with_the_old_amax(shape, steps, seed):
    """adamw_'s FP8 copies (fp32 quotients under the interpreter, as fp8_quant's tests take them) equal
    quantize_weight_reference(new p, amax of the old p) in both layouts, the kept amax is the new p's,
    the update is the plain one bit for bit, and a non-finite scale leaves copies and amax alone."""
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(shape, generator=gen) * 0.02
    for fn in (adamw_, adamw_reference_):
        p, m, v = p0.clone().requires_grad_(), torch.zeros(shape), torch.zeros(shape)
        plain = p0.clone()
        pm, pv = torch.zeros(shape), torch.zeros(shape)
        amax = weight_amax(p0)
        copies = quantize_weight(p0, amax, torch.float32)
        keep(p, (*copies, amax), FP8)
        for step in range(1, steps + 1):
            g, kw = (
                torch.randn(shape, generator=gen),
                dict(lr=0.3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8),
            )
            old = kept_copy(p, FP8)
            with torch.no_grad():
                fn(p, g, m, v, torch.tensor([0.8]), step=step, fp8=old, **kw)
                fn(plain, g, pm, pv, torch.tensor([0.8]), step=step, **kw)
            new = kept_copy(p, FP8)
            assert new is not None and all(a is b for a, b in zip(new[:4], old[:4]))
            assert torch.equal(p.detach(), plain) and torch.equal(new[4], weight_amax(p.detach()))
            for got, want in zip(
                new[:4], quantize_weight_reference(p.detach().reshape(-1, *shape[-2:]), old[4], torch.float32)
            ):
                assert torch.equal(got, want.reshape(got.shape))
        assert (new[0].abs() == 448).any()  # the weights grew past the old amax somewhere: saturated
        before = [t.clone() for t in new]
        with torch.no_grad():
            fn(p, g, m, v, torch.tensor([math.nan]), step=steps + 1, fp8=new, **kw)
        assert all(torch.equal(a, b) for a, b in zip(kept_copy(p, FP8), before))


def test_a_kept_copy_not_rewritten_is_dropped():
    p = torch.randn(8, 16, requires_grad=True)
    keep(p, quantize_weight(p.detach()), FP8)
    with torch.no_grad():
        adamw_(p, torch.randn(8, 16), torch.zeros(8, 16), torch.zeros(8, 16), torch.ones(1), lr=0.1,
               beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8, step=1)  # fmt: skip
    assert kept_copy(p, FP8) is None


@pytest.mark.gpu
def test_fp8_copies_on_gpu_are_the_kernels_new_parameter_quantised():
    """The compiled kernels' e4m3 casts (the interpreter's are wrong for some values): adamw_'s copies
    equal quantize_weight_reference of the p it wrote with the old amax, bit for bit, at expert size."""
    gen = torch.Generator("cuda").manual_seed(0)
    for shape in ((8, 2048, 1536), (4096, 2048), (3, 40, 24)):
        p = (torch.randn(shape, device="cuda", generator=gen) * 0.02).requires_grad_()
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        keep(p, (*quantize_weight(p.detach()), weight_amax(p)), FP8)
        for step in (1, 2):
            old = kept_copy(p, FP8)
            g = torch.randn(shape, device="cuda", generator=gen).bfloat16()
            with torch.no_grad():
                adamw_(p, g, m, v, torch.ones(1, device="cuda"), lr=1e-2, beta1=0.9, beta2=0.95,
                       weight_decay=0.1, eps=1e-8, step=step, fp8=old)  # fmt: skip
            new = kept_copy(p, FP8)
            p3 = p.detach().reshape(-1, *shape[-2:])
            for got, want in zip(new[:4], quantize_weight_reference(p3, old[4])):
                want = want.reshape(got.shape)
                same = got.view(torch.uint8) == want.view(torch.uint8) if got.dtype == FP8 else got == want
                assert same.all(), (shape, step, (~same).sum().item())
            assert torch.equal(new[4], weight_amax(p3))


def test_bad_fp8_copies_are_a_value_error_before_any_write():
    p, copies = torch.ones(4, 6), (*quantize_weight(torch.ones(4, 6)), weight_amax(torch.ones(4, 6)))
    for bad, match in ((copies[:4], "the 5 FP8Weight tensors"), ((*copies[:4], torch.ones(2)), "one amax")):
        with pytest.raises(ValueError, match=match):
            adamw_(p, torch.ones(4, 6), torch.zeros(4, 6), torch.zeros(4, 6), torch.ones(1), lr=0.1,
                   beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8, step=1, fp8=bad)  # fmt: skip
        assert torch.equal(p, torch.ones(4, 6))
