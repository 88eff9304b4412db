"""linear_cross_entropy against its float64 reference: loss, dh, dw, chunking, opcheck, errors.

Shape legend: T tokens, D model dim, V vocabulary.
"""

import pith_ops.cross_entropy as ce
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import linear_cross_entropy, linear_cross_entropy_reference


def close(got, want, tol):
    """Elementwise, the absolute slack scaled to the largest expected entry (mean-reduced grads are tiny)."""
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def check_lce(
    T, D, V, reduction, ignored, seed, dtype=torch.float32, device="cpu", tol=1e-5, ignore_index=-100
):
    g = torch.Generator().manual_seed(seed)
    h_TD = torch.randn(T, D, generator=g).to(device, dtype).requires_grad_()
    w_VD = (torch.randn(V, D, generator=g) / D**0.5).to(device, dtype).requires_grad_()
    labels_T = torch.randint(0, V, (T,), generator=g)
    labels_T[torch.rand(T, generator=g) < ignored] = ignore_index
    labels_T = labels_T.to(device)
    loss = linear_cross_entropy(h_TD, w_VD, labels_T, ignore_index, reduction)
    h64, w64 = h_TD.detach().double().requires_grad_(), w_VD.detach().double().requires_grad_()
    ref = linear_cross_entropy_reference(h64, w64, labels_T, ignore_index, reduction)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    # An upstream gradient other than 1 checks that the backward scales the kept gradients.
    dh, dw = torch.autograd.grad(3 * loss, (h_TD, w_VD))
    ref_dh, ref_dw = torch.autograd.grad(3 * ref, (h64, w64))
    close(dh, ref_dh, tol)
    close(dw, ref_dw, tol)


@given(
    T=st.integers(1, 24),
    D=st.integers(1, 24),
    V=st.integers(2, 700),
    reduction=st.sampled_from(["mean", "sum"]),
    ignored=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_loss_and_gradients_match_reference(T, D, V, reduction, ignored, seed):
    # Chunks of five tokens, so the chunk loop and a ragged last chunk run at these small sizes.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ce, "CHUNK_LOGITS", 5 * V)
        check_lce(T, D, V, reduction, ignored, seed)


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


def test_opcheck():
    h_TD, w_VD = torch.randn(6, 8, requires_grad=True), torch.randn(33, 8, requires_grad=True)
    labels_T = torch.tensor([1, 2, -100, 32, 0, 5])
    torch.library.opcheck(
        torch.ops.pith.linear_cross_entropy, (h_TD, w_VD, labels_T, -100, "mean", True, True)
    )


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


@pytest.mark.gpu
def test_bf16_on_gpu_at_vocabulary_scale(monkeypatch):
    monkeypatch.setattr(ce, "CHUNK_LOGITS", 2**26)  # 441 tokens per chunk: several chunks at T = 2048
    check_lce(2048, 256, 151936, "mean", 0.1, seed=0, dtype=torch.bfloat16, device="cuda", tol=2e-2)


def test_compiles_to_one_graph_with_gradients():
    h_TD, w_VD = torch.randn(6, 8, requires_grad=True), torch.randn(33, 8, requires_grad=True)
    labels_T = torch.tensor([1, 2, -100, 32, 0, 5])
    loss = torch.compile(linear_cross_entropy, backend="aot_eager", fullgraph=True)(h_TD, w_VD, labels_T)
    ref = linear_cross_entropy_reference(h_TD, w_VD, labels_T)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    got, want = torch.autograd.grad(loss, (h_TD, w_VD)), torch.autograd.grad(ref, (h_TD, w_VD))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
