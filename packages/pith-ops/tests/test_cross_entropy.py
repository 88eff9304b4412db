"""linear_cross_entropy against its float64 references: loss, dh, dw, chunking, FP8, opcheck, errors.

Shape legend: T tokens, C tokens of a chunk, D model dim, V vocabulary.

FP8 (w8) tolerances, elementwise bounds computed from the data (fp8_bounds): the op's logits differ
from the FP8 reference's by their bf16 rounding (2^-8 relative) and the accumulation over D (2^-23 a
term in fp32; 2^-13 with CUDA's fast accumulation, which keeps ~14 bits); against the exact logits
also by the e4m3 operands (3 mantissa bits: within half a step, 2^-4 relative, of the value, or 2^-10
scale < 2^-17 amax where subnormal). A token's loss moves by at most twice its largest logit error d
(lse and the target are 1-Lipschitz in the max norm), its gradient entries by (e^2d - 1) p s. dh
compares e4m3 gradient rows quantised from two nearby gradients: each within half a step of its own,
so they differ by the gradient difference plus a step (2^-3 relative) where one rounds across a
midpoint. dw multiplies those rows and h's, requantised by columns over the tokens: the same values
rescaled by powers of two, but where they become e4m3 subnormals (half a step: 2^-10 of the column
scale, itself below 2^-7 of the largest entry). The kernel's e4m3 rows are checked bit
for bit against quantize_rows_reference of the gradient it writes (fp32 quotients under the
interpreter, whose e4m3 cast is wrong for some values).
"""

import math

import pith_ops.cross_entropy as ce
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import (
    linear_cross_entropy,
    linear_cross_entropy_reference,
    quantize_rows_reference,
    quantize_weight,
)
from pith_ops.cross_entropy import linear_cross_entropy_fp8_reference


def close(got, want, tol):
    """Elementwise, the absolute slack scaled to the largest expected entry (mean-reduced grads are tiny)."""
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def within(got, want, bound):
    """|got - want| <= bound elementwise (nan where both are: a mean over no kept token)."""
    err = (got.double() - want).abs()
    ok = (err <= bound) | (got.isnan() & want.isnan())
    assert ok.all(), f"{(~ok).sum().item()} entries past the bound, worst by {(err - bound).max().item():.3g}"


def inputs(T, D, V, ignored, seed, dtype=torch.float32, device="cpu", ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    h_TD = torch.randn(T, D, generator=g).to(device, dtype).requires_grad_()
    w_VD = (torch.randn(V, D, generator=g) / D**0.5).to(device, dtype).requires_grad_()
    labels_T = torch.randint(0, V, (T,), generator=g)
    labels_T[torch.rand(T, generator=g) < ignored] = ignore_index
    return h_TD, w_VD, labels_T.to(device)


def check_lce(
    T, D, V, reduction, ignored, seed, dtype=torch.float32, device="cpu", tol=1e-5, ignore_index=-100
):
    h_TD, w_VD, labels_T = inputs(T, D, V, ignored, seed, dtype, device, ignore_index)
    loss = linear_cross_entropy(h_TD, w_VD, labels_T, ignore_index, reduction)
    h64, w64 = h_TD.detach().double().requires_grad_(), w_VD.detach().double().requires_grad_()
    ref = linear_cross_entropy_reference(h64, w64, labels_T, ignore_index, reduction)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol, equal_nan=True)  # nan: none kept
    # An upstream gradient other than 1 checks that the backward scales the kept gradients.
    dh, dw = torch.autograd.grad(3 * loss, (h_TD, w_VD))
    ref_dh, ref_dw = torch.autograd.grad(3 * ref, (h64, w64))
    close(dh, ref_dh, tol)
    close(dw, ref_dw, tol)


def fp8_bounds(h_TD, w_VD, labels_T, ignore_index, reduction, dloss):
    """-> bounds on |op - fp8 reference| for loss, dh, dw, and on |op loss - exact| (module docstring)."""
    h8, w8 = ce.dequantized(h_TD, w_VD)
    h, w, x = h_TD.double(), w_VD.double(), h8 @ w8.T
    (T, D), V = h.shape, w.shape[0]
    valid = labels_T != ignore_index
    s_T = valid / valid.sum().clamp(min=1) if reduction == "mean" else valid.double()
    p = x.softmax(1)
    g = (p - torch.nn.functional.one_hot(torch.where(valid, labels_T, 0), V)) * s_T[:, None]
    u = torch.finfo(h_TD.dtype).eps / 2  # h's dtype: the logits buffer, the gradient, dh

    def acc(K, fast):  # an accumulation's error over K terms, relative to the sum of |terms|
        return K * (2**-13 if fast and h_TD.is_cuda else 2**-23)

    # The op's logits: bf16 GEMM output, cast to h's dtype, accumulated over D; fp32 x - lse in the kernel.
    dx = (2**-8 + u) * x.abs() + acc(D, True) * (h8.abs() @ w8.abs().T) + 2**-20 * (1 + x.abs())
    eh = 2**-4 * h.abs() + 2**-17 * h.abs().amax(1, keepdim=True)  # e4m3 h: its row's scale
    ew = 2**-4 * w.abs() + 2**-17 * w.abs().max()  # e4m3 w: one scale
    dx_exact = dx + eh @ (w.abs() + ew).T + h.abs() @ ew.T

    def loss_bound(d):  # 2 d per kept token, reduced, and the fp32 sum over the tokens
        return 2 * (d.amax(1) * s_T).sum() + 2**-20 * T * (s_T * x.abs().amax(1)).sum()

    eg = (math.e ** (2 * dx.amax(1, keepdim=True)) - 1) * p * s_T[:, None]  # |op's g - g|
    ga = g.abs() + eg  # >= |op's g|
    # The two e4m3 rows: each within half a step of its gradient (2^-4 relative, or 2^-17 of the row's
    # amax where subnormal), and the gradients eg apart.
    e8 = 2**-4 * (g.abs() + ga) + 2**-16 * ga.amax(1, keepdim=True) + eg
    # dh's GEMM: bf16 output, its cast to h's dtype and the backward's product with dloss.
    dh = dloss * (e8 @ w8.abs() + (2**-8 + 2 * u + acc(V, ce.FAST)) * ((ga + e8) @ w8.abs()))
    # dw: the two rows' values requantised by columns (subnormal roundings), the same h8 columns, fp32
    # within the GEMM over the tokens, its bf16 output and the backward's product with dloss.
    e8c, hc = e8 + 2**-16 * ga.max(), (1 + 2**-4) * h.abs() + 2**-16 * h.abs().max()
    parts = len(ce.fp8_wgrad_part_ends(T, V))  # each part's bf16 output, then their bf16 sums
    dw = dloss * (e8c.T @ hc + (2**-8 * parts + u + acc(T, False)) * ((ga + e8c).T @ hc))
    return loss_bound(dx), dh, dw, loss_bound(dx_exact)


def check_fp8(T, D, V, reduction, ignored, seed, dtype=torch.float32, device="cpu", ignore_index=-100):
    """-> relative Frobenius errors of dh and dw against the exact float64 gradients."""
    h_TD, w_VD, labels_T = inputs(T, D, V, ignored, seed, dtype, device, ignore_index)
    w8 = quantize_weight(w_VD.detach())
    loss = linear_cross_entropy(h_TD, w_VD, labels_T, ignore_index, reduction, w8=w8)
    assert loss.dtype == torch.float32 and loss.shape == ()
    dh, dw = torch.autograd.grad(3 * loss, (h_TD, w_VD))
    assert dh.dtype == dw.dtype == dtype
    h, w = h_TD.detach(), w_VD.detach()
    with torch.no_grad():  # no gradient rows written; then dw alone, without the e4m3 rows
        no_grad = linear_cross_entropy(h, w, labels_T, ignore_index, reduction, w8=w8)
    torch.testing.assert_close(no_grad, loss.detach(), rtol=0, atol=0, equal_nan=True)  # nan: none kept
    only_w = linear_cross_entropy(h, w_VD, labels_T, ignore_index, reduction, w8=w8)
    only_dw = torch.autograd.grad(3 * only_w, w_VD)[0]
    only_h = linear_cross_entropy(h_TD, w, labels_T, ignore_index, reduction, w8=w8)  # per-chunk rows
    only_dh = torch.autograd.grad(3 * only_h, h_TD)[0]
    if device == "cpu":
        assert torch.equal(only_dw, dw) and torch.equal(only_dh, dh)
    else:  # within a bf16 rounding (cuBLAS need not be bit-reproducible across calls)
        for got, want in ((only_dw, dw), (only_dh, dh)):
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    ref = linear_cross_entropy_fp8_reference(h, w, labels_T, ignore_index, reduction, dloss=3.0)
    *bounds, exact_bound = fp8_bounds(h, w, labels_T, ignore_index, reduction, 3.0)
    for got, want, bound in zip((loss, dh, dw), ref, bounds):
        within(got, want, bound)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    exact = linear_cross_entropy_reference(h64, w64, labels_T, ignore_index, reduction)
    within(loss, exact, exact_bound)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    return [rel(a, b) for a, b in zip((dh, dw), torch.autograd.grad(3 * exact, (h64, w64)))]


def check_g8(C, V, magnitude, scale, ignored, at_max, seed, device="cpu"):
    """The kernel on fp32 logits: loss and gradient against float64, and its e4m3 rows (fp32 quotients
    under the interpreter) bit for bit quantize_rows_reference of the gradient it wrote."""
    g = torch.Generator().manual_seed(seed)
    x_CV = torch.randn(C, V, generator=g) * magnitude
    labels_C = torch.randint(0, V, (C,), generator=g)
    top = torch.rand(C, generator=g) < at_max  # the label at the row's largest logit: amax elsewhere
    labels_C[top] = x_CV.argmax(1)[top]
    labels_C[torch.rand(C, generator=g) < ignored] = -100
    x_CV, labels_C = x_CV.to(device), labels_C.to(device)
    logits_CV, loss_C = x_CV.clone(), x_CV.new_empty(C)
    q_dtype = torch.float32 if ce.INTERPRET else ce.FP8
    g8 = torch.empty_like(x_CV, dtype=q_dtype), x_CV.new_empty(C)
    ce._ce_rows(logits_CV, labels_C, loss_C, torch.tensor(scale, device=device), -100, True, g8)
    ref_loss, ref_g = x_CV.new_empty(C, dtype=torch.float64), x_CV.double()
    ce._ce_rows(ref_g, labels_C, ref_loss, torch.tensor(scale, device=device), -100, True)
    # fp32 x - lse: absolute errors of a few ulp of the logits (randn: within 5 magnitudes).
    atol = 2**-20 * (1 + magnitude)
    torch.testing.assert_close(loss_C.double(), ref_loss, rtol=1e-5, atol=atol)
    torch.testing.assert_close(logits_CV.double(), ref_g, rtol=1e-4, atol=atol * scale)
    q, s = quantize_rows_reference(logits_CV, q_dtype)
    assert torch.equal(g8[1], s) and torch.equal(g8[0].view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("check", [check_lce, check_fp8], ids=["bf16", "fp8"])
@given(
    T=st.integers(1, 24),
    D=st.integers(1, 24),
    V=st.integers(2, 700),
    reduction=st.sampled_from(["mean", "sum"]),
    ignored=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_loss_and_gradients_match_reference_bf16_and_within_bounds_in_fp8(
    check, T, D, V, reduction, ignored, seed
):
    # Chunks of five tokens, so the chunk loop and a ragged last chunk run at these small sizes.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ce, "CHUNK_LOGITS", 5 * V)
        check(T, D, V, reduction, ignored, seed)


def test_one_token_and_other_ignore_index():
    check_lce(1, 7, 3, "mean", 0.0, seed=0, ignore_index=0)


def test_fp16_matches_reference():
    check_lce(11, 16, 300, "mean", 0.2, seed=1, dtype=torch.float16, tol=5e-3)


def test_no_grad_forward_keeps_no_gradients():
    h_TD, w_VD = torch.randn(5, 4, requires_grad=True), torch.randn(9, 4)
    labels_T = torch.tensor([1, 2, -100, 8, 0])
    with torch.no_grad():
        loss = linear_cross_entropy(h_TD, w_VD, labels_T)
    ref = linear_cross_entropy_reference(h_TD.double(), w_VD.double(), labels_T)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    assert loss.grad_fn is None
    (dh,) = torch.autograd.grad(linear_cross_entropy(h_TD, w_VD, labels_T), h_TD)  # w needs no gradient
    (ref_dh,) = torch.autograd.grad(linear_cross_entropy_reference(h_TD, w_VD, labels_T), h_TD)
    torch.testing.assert_close(dh, ref_dh, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True])
def test_opcheck(fp8):
    h_TD, w_VD = torch.randn(6, 8, requires_grad=True), torch.randn(33, 8, requires_grad=True)
    labels_T = torch.tensor([1, 2, -100, 32, 0, 5])
    w8 = quantize_weight(w_VD.detach()) if fp8 else ()
    args = (h_TD, w_VD, labels_T, -100, "mean", True, True, *w8)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    # test_schema multiplies the inputs, and CPU has no mul for e4m3.
    torch.library.opcheck(torch.ops.pith.linear_cross_entropy, args, test_utils=tests[fp8:])


def test_bad_inputs_raise_value_error():
    h_TD, w_VD, labels_T = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, -100])
    with pytest.raises(ValueError, match="w_VD: expected dtype"):
        linear_cross_entropy(h_TD, w_VD.half(), labels_T)
    with pytest.raises(ValueError, match="expected 8 columns"):
        linear_cross_entropy(h_TD, torch.randn(10, 7), labels_T)
    with pytest.raises(ValueError, match="expected 4 labels"):
        linear_cross_entropy(h_TD, w_VD, labels_T[:3])
    with pytest.raises(ValueError, match="labels_T: expected dtype"):
        linear_cross_entropy(h_TD, w_VD, labels_T.float())
    with pytest.raises(ValueError, match="h_TD: expected 2 dimensions"):
        linear_cross_entropy(h_TD[None], w_VD, labels_T)
    with pytest.raises(ValueError, match="contiguous"):
        linear_cross_entropy(torch.randn(8, 4).T, w_VD, labels_T)
    with pytest.raises(ValueError, match="on cpu"):
        linear_cross_entropy(h_TD, w_VD, labels_T.to("meta"))
    with pytest.raises(ValueError, match=r"ids in \[0, 10\) or -100, got 10"):
        linear_cross_entropy(h_TD, w_VD, torch.tensor([1, 10, 3, -100]))
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h_TD, w_VD, labels_T, reduction="none")
    w8 = quantize_weight(w_VD)
    with pytest.raises(ValueError, match="expected the 4 tensors"):
        linear_cross_entropy(h_TD, w_VD, labels_T, w8=w8[:2])
    with pytest.raises(ValueError, match=r"w8\[1\]: expected dtype"):
        linear_cross_entropy(h_TD, w_VD, labels_T, w8=(w8[0], w8[1].double(), *w8[2:]))
    with pytest.raises(ValueError, match=r"w8\[2\]: expected shape \(8, 10\)"):
        linear_cross_entropy(h_TD, w_VD, labels_T, w8=(*w8[:2], w8[0], w8[3]))


@pytest.mark.gpu
def test_bf16_on_gpu_at_vocabulary_scale(monkeypatch):
    monkeypatch.setattr(ce, "CHUNK_LOGITS", 2**26)  # 441 tokens per chunk: several chunks at T = 2048
    check_lce(2048, 256, 151936, "mean", 0.1, seed=0, dtype=torch.bfloat16, device="cuda", tol=2e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_compiles_to_one_graph_with_gradients(fp8):
    h_TD, w_VD = torch.randn(6, 8, requires_grad=True), torch.randn(33, 8, requires_grad=True)
    labels_T = torch.tensor([1, 2, -100, 32, 0, 5])
    w8 = quantize_weight(w_VD.detach()) if fp8 else None
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(linear_cross_entropy, backend=backend, fullgraph=True)
    loss = compiled(h_TD, w_VD, labels_T, w8=w8)
    calls = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and calls.count(torch.ops.pith.linear_cross_entropy.default) == 1
    eager = linear_cross_entropy(h_TD, w_VD, labels_T, w8=w8)
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    got, want = torch.autograd.grad(loss, (h_TD, w_VD)), torch.autograd.grad(eager, (h_TD, w_VD))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if not fp8:
        ref = linear_cross_entropy_reference(h_TD, w_VD, labels_T)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


def test_fp8_one_token_fp16_torch_path_and_error_against_the_exact_gradients(monkeypatch):
    check_fp8(1, 16, 2, "sum", 0.0, seed=0, ignore_index=0)
    monkeypatch.setattr(ce, "FP8_WGRAD_ROWS", 128)  # dw's GEMMs over several vocabulary slices
    check_fp8(11, 16, 300, "mean", 0.2, seed=1, dtype=torch.float16)
    # e4m3 h, w and gradient rows: dh's and dw's relative errors ~3e-2.
    assert max(check_fp8(64, 128, 512, "mean", 0.1, seed=2)) < 0.06
    monkeypatch.setattr(ce, "CHUNK_LOGITS", 16 * 512)  # chunks of 16 tokens: dw in parts of 32, then 16
    assert ce.fp8_wgrad_part_ends(64, 512) == [32, 64]
    assert max(check_fp8(64, 128, 512, "mean", 0.1, seed=2)) < 0.06
    monkeypatch.setattr(ce, "FP8_WGRAD_PARTS", 4)
    assert ce.fp8_wgrad_part_ends(56, 512) == [16, 32, 48, 56]
    check_fp8(56, 32, 512, "sum", 0.1, seed=4)
    with monkeypatch.context() as mp:  # CPU without the interpreter: torch ops stand in for the kernel
        mp.setattr(ce, "use_triton", lambda t: t.is_cuda)
        check_fp8(13, 24, 300, "mean", 0.2, seed=3)


@given(
    C=st.integers(1, 6),
    V=st.integers(1, 600),
    magnitude=st.sampled_from([1e-3, 1.0, 30.0, 1e3]),
    scale=st.sampled_from([1.0, 1 / 3, 2**-20]),
    ignored=st.sampled_from([0.0, 0.4]),
    at_max=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_kernel_gradient_rows_are_quantize_rows_of_the_gradient_it_writes(
    C, V, magnitude, scale, ignored, at_max, seed
):
    check_g8(C, V, magnitude, scale, ignored, at_max, seed)


@pytest.mark.gpu
def test_fp8_bf16_on_gpu_at_vocabulary_scale(monkeypatch):
    check_g8(64, 151936, 4.0, 1 / 1843, 0.1, 0.3, seed=0, device="cuda")  # e4m3 bytes, bit for bit
    monkeypatch.setattr(ce, "CHUNK_LOGITS", 2**26)  # 441 tokens per chunk: several chunks at T = 2048
    check_fp8(2048, 256, 151936, "mean", 0.1, seed=0, dtype=torch.bfloat16, device="cuda")
