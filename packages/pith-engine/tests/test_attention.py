"""attention(): the fast paths (SDPA, flex_attention + sinks from the LSE) against attention_reference
in float64, and the properties of the reference the fast paths rely on.

Shape legend: B batch, S sequence, H query heads, G key/value heads, D q/k head dim, Dv v head dim.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_engine.attention import attention, attention_reference, sdpa_attention
from pith_engine.contract import Positions


def qkv(B, S, H, G, D, Dv, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)
    return (
        make(B, S, H, D).requires_grad_(),
        make(B, S, G, D).requires_grad_(),
        make(B, S, G, Dv).requires_grad_(),
    )


def in_order(B, S, device="cpu", start=0):
    return torch.arange(start, start + S, device=device).expand(B, S)


def grads(out, inputs, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad(out, inputs, dout.to(out.device, out.dtype))


shapes = st.tuples(
    st.integers(1, 2),  # B
    st.integers(1, 19),  # S
    st.integers(1, 2),  # G
    st.sampled_from([1, 2, 3]),  # H // G
    st.sampled_from([4, 8]),  # D
    st.sampled_from([4, 6]),  # Dv
)


@given(shapes, st.integers(0, 7))
def test_sdpa_path_matches_the_reference(shape, start):
    """Forward and every gradient of the SDPA path in fp32 against the fp64 reference."""
    B, S, G, rep, D, Dv = shape
    q, k, v = qkv(B, S, G * rep, G, D, Dv)
    pos_BS = in_order(B, S, start=start)
    expected, _ = attention_reference(q, k, v, pos_BS, pos_BS, scale=D**-0.5)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    got = sdpa_attention(q32, k32, v32, scale=D**-0.5)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    for g32, g64 in zip(grads(got, (q32, k32, v32)), grads(expected, (q, k, v))):
        torch.testing.assert_close(g32.double(), g64, rtol=1e-4, atol=1e-5)


@given(shapes, st.sampled_from([None, 1, 3]), st.booleans())
def test_sinks_can_be_applied_from_the_lse(shape, window, use_sinks):
    """The identity the flex path uses: with sinks, out = out_without * sigmoid(lse - sink)."""
    B, S, G, rep, D, Dv = shape
    q, k, v = qkv(B, S, G * rep, G, D, Dv)
    sinks_H = torch.randn(G * rep, dtype=torch.float64, requires_grad=True) if use_sinks else None
    pos_BS = in_order(B, S)
    plain, lse_BHS = attention_reference(q, k, v, pos_BS, pos_BS, scale=0.7, window=window)
    with_sinks, lse2_BHS = attention_reference(
        q, k, v, pos_BS, pos_BS, scale=0.7, window=window, sinks_H=sinks_H
    )
    keep_BHS = torch.ones_like(lse_BHS) if sinks_H is None else torch.sigmoid(lse_BHS - sinks_H[:, None])
    from_lse = plain * keep_BHS.transpose(1, 2)[..., None]
    torch.testing.assert_close(with_sinks, from_lse)
    torch.testing.assert_close(lse2_BHS, lse_BHS)  # lse excludes the sinks (ring attention merges it)
    # ... and so are its gradients, provided the kernel differentiates through the lse (flex does)
    wrt = (q, k, v) + ((sinks_H,) if use_sinks else ())
    for g, g_expected in zip(grads(from_lse, wrt), grads(with_sinks, wrt)):
        torch.testing.assert_close(g, g_expected)


def test_reference_mask_follows_positions_not_indices():
    """Permuting the tokens (as the zigzag split of context parallelism does) permutes the output."""
    B, S, H, D = 1, 12, 2, 8
    q, k, v = qkv(B, S, H, H, D, D)
    pos_BS = in_order(B, S)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(0))
    for window in (None, 4):
        out, _ = attention_reference(q, k, v, pos_BS, pos_BS, scale=0.5, window=window)
        shuffled, _ = attention_reference(
            q[:, perm], k[:, perm], v[:, perm], pos_BS[:, perm], pos_BS[:, perm], scale=0.5, window=window
        )
        torch.testing.assert_close(shuffled, out[:, perm])


def test_reference_against_a_direct_loop():
    """The specification itself: one query at a time, softmax over visible keys plus the sink."""
    S, H, D, window = 7, 2, 4, 3
    q, k, v = qkv(1, S, H, 1, D, D)
    sinks_H = torch.tensor([0.3, -1.0], dtype=torch.float64)
    pos_BS = in_order(1, S)
    out, _ = attention_reference(q, k, v, pos_BS, pos_BS, scale=0.5, window=window, sinks_H=sinks_H)
    for i in range(S):
        for h in range(H):
            keys = [j for j in range(S) if 0 <= i - j < window]
            scores = torch.stack([q[0, i, h] @ k[0, j, 0] * 0.5 for j in keys])
            w = torch.exp(scores) / (torch.exp(scores).sum() + torch.exp(sinks_H[h]))
            torch.testing.assert_close(out[0, i, h], (w[:, None] * v[0, keys, 0]).sum(0))


# ---- CUDA: attention() dispatches to SDPA or flex_attention; bf16 against the fp64 reference.
CUDA_CASES = {
    "gqa-causal-sdpa": dict(H=8, G=2, D=64, Dv=64, window=None, sinks=False),
    "mla-dims-sdpa": dict(H=4, G=4, D=96, Dv=64, window=None, sinks=False),
    "window-flex": dict(H=8, G=2, D=64, Dv=64, window=100, sinks=False),
    "window-sinks-flex": dict(H=8, G=2, D=64, Dv=64, window=100, sinks=True),
    "sinks-full-flex": dict(H=8, G=2, D=64, Dv=64, window=None, sinks=True),
    "tiny-head-reference": dict(H=4, G=2, D=8, Dv=8, window=5, sinks=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_attention_matches_the_reference(case):
    c = CUDA_CASES[case]
    B, S = 2, 300
    q, k, v = qkv(B, S, c["H"], c["G"], c["D"], c["Dv"], dtype=torch.bfloat16, device="cuda")
    sinks_H = torch.randn(c["H"], device="cuda", requires_grad=True) if c["sinks"] else None
    pos = Positions(in_order(B, S, "cuda"), None, None, None)
    inputs = (q, k, v) + ((sinks_H,) if c["sinks"] else ())
    got = attention(q, k, v, pos, scale=c["D"] ** -0.5, window=c["window"], sinks_H=sinks_H)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    q64, k64, v64 = ref_inputs[:3]
    s64 = ref_inputs[3] if c["sinks"] else None
    expected, _ = attention_reference(
        q64,
        k64,
        v64,
        pos.position_ids_BS,
        pos.position_ids_BS,
        scale=c["D"] ** -0.5,
        window=c["window"],
        sinks_H=s64,
    )
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)
    for name, g, g64 in zip("qkvs", grads(got, inputs), grads(expected, ref_inputs)):
        err = (g.double() - g64).norm() / g64.norm()
        assert err < 3e-2, f"d{name}: relative error {err:.3g}"
