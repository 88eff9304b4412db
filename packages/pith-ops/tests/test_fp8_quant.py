"""fp8_quant's kernels against their references (scales bit-exact, values bit-exact), and the references'
own properties in float64: power-of-two scales as small as allowed, no saturation past 448, round-trip
error within half an e4m3 step.

Shape legend: B batch, M rows, K columns, G row groups, R and C a weight's rows and columns.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import (
    cols_from_rows,
    cols_from_rows_reference,
    copies_of_quantized,
    quantize_rows,
    quantize_rows_reference,
    quantize_weight,
    quantize_weight_reference,
)
from pith_ops.fp8_quant import FP8, dequantize_cols, dequantize_rows, pow2_scale


def _data(shape, seed, dtype=torch.float32, device="cpu"):
    """Rows of widely different magnitudes (2^-20 .. 2^20), some all zero."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(shape, generator=g)
        * torch.exp2(torch.randint(-20, 21, shape[:-1], generator=g))[..., None]
    )
    if x.shape[-2] > 2:
        x[..., 1, :] = 0
    return x.to(device, dtype)


def _check_round_trip(x_MK: torch.Tensor, deq_MK: torch.Tensor, scale_MK: torch.Tensor) -> None:
    """|deq - x| <= half an e4m3 step: 2^-4 |x| for normal values, scale * 2^-10 below 2^-6 * scale."""
    x = x_MK.double()
    assert ((deq_MK - x).abs() <= torch.maximum(x.abs() * 2**-4, scale_MK.double() * 2**-10)).all()


def _check_scales(amax: torch.Tensor, scale: torch.Tensor) -> None:
    """Powers of two, the smallest with amax / scale <= 448."""
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()
    nonzero = amax > 2**-100
    assert (amax / scale <= 448).all() and (amax[nonzero] / scale[nonzero] > 224).all()


@given(M=st.integers(1, 40), K=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_quantize_rows_kernel_matches_reference_and_round_trips(M, K, seed):
    x_MK = _data((M, K), seed)
    q, scale = quantize_rows(x_MK, torch.float32)  # the kernel's quotients before the cast
    ref_q, ref_scale = quantize_rows_reference(x_MK, torch.float32)
    assert torch.equal(scale, ref_scale) and torch.equal(q, ref_q)
    q8, scale8 = quantize_rows(x_MK)
    ref_q8, _ = quantize_rows_reference(x_MK)
    assert q8.dtype == FP8 and torch.equal(scale8, ref_scale)
    assert torch.equal(q8.view(torch.uint8), ref_q8.view(torch.uint8))
    _check_scales(x_MK.abs().amax(1), scale8)
    _check_round_trip(x_MK, dequantize_rows(q8, scale8), scale8[:, None].expand(M, K))


@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    tail=st.integers(0, 5),
    K=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_cols_from_rows_kernel_matches_reference_per_group_and_round_trips(sizes, tail, K, seed):
    ends_G = torch.tensor(sizes).cumsum(0).to(torch.int32)
    used = int(ends_G[-1])
    x_MK = _data((used + tail, K), seed, torch.bfloat16)
    q8, s8 = quantize_rows(x_MK)
    q, scale = cols_from_rows(q8, s8, ends_G, torch.float32)
    qc8, scale8 = cols_from_rows(q8, s8, ends_G)
    ref_q, ref_scale = cols_from_rows_reference(q8, s8, ends_G, torch.float32)
    assert q.shape == (K, used + tail) and (q.stride(0) % 16 == 0 or not used + tail)
    assert scale.shape == (len(sizes), K)
    assert torch.equal(scale, ref_scale) and torch.equal(q[:, :used], ref_q[:, :used])
    assert torch.equal(scale8, ref_scale) and qc8.dtype == FP8
    ref_q8 = cols_from_rows_reference(q8, s8, ends_G)[0]
    assert torch.equal(qc8[:, :used].view(torch.uint8), ref_q8[:, :used].view(torch.uint8))
    start = 0
    for g, end in enumerate(ends_G.tolist()):  # the group's scale: its largest row scale
        assert (scale8[g] == (s8[start:end].max() if end > start else 2.0**-126)).all()
        start = max(start, end)
    rows = dequantize_rows(q8, s8)  # the values rescaled: within half an e4m3 step at the group's scale
    deq = dequantize_cols(qc8, scale8, ends_G)[:, :used]
    scale_KM = scale8.T.repeat_interleave(torch.tensor(sizes), dim=1)
    _check_round_trip(rows[:used].T, deq, scale_KM)
    lo = K // 3  # a slice of columns (rows K apart): its own columns of the whole's result
    q_cut, scale_cut = cols_from_rows(q8[:, lo:], s8, ends_G)
    assert torch.equal(scale_cut, scale8[:, lo:])
    assert torch.equal(q_cut[:, :used].view(torch.uint8), qc8[lo:, :used].view(torch.uint8))


def test_cols_from_rows_rescales_exactly_where_values_stay_normal():
    """Row and group scales are powers of two: a value that is a normal e4m3 number at both scales
    keeps its bits but the exponent; only those turning subnormal are rounded again."""
    g = torch.Generator().manual_seed(0)
    x_MK = torch.randn(64, 48, generator=g) * torch.exp2(torch.randint(-4, 5, (64, 1), generator=g).float())
    q8, s8 = quantize_rows(x_MK)
    qc, scale = cols_from_rows(q8, s8)
    rows, at_group = dequantize_rows(q8, s8), qc.T.double() * scale[0, 0].double()
    normal = rows.abs() >= 2**-6 * scale[0, 0]  # before the rounding at the group's scale
    assert normal.float().mean() > 0.8 and torch.equal(at_group[normal], rows[normal])


@given(B=st.integers(1, 3), R=st.integers(1, 40), C=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_quantize_weight_kernel_matches_reference_in_both_layouts(B, R, C, seed):
    w_BRC = _data((B, R, C), seed).mul_(2.0**-10)
    amax = w_BRC.abs().flatten(1).amax(1)
    for amax_B in (None, amax * 0.75):  # its own amax, and an older smaller one: the excess saturates
        q, s_rows, qt, s_cols = quantize_weight(w_BRC, amax_B, torch.float32)
        ref = quantize_weight_reference(w_BRC, amax_B, torch.float32)
        for got, want in zip((q, s_rows, qt, s_cols), ref):
            assert torch.equal(got, want)
        q8, *_, qt8, _ = quantize_weight(w_BRC, amax_B)
        assert torch.equal(q8.view(torch.uint8), ref[0].to(FP8).view(torch.uint8))
        assert torch.equal(qt8.view(torch.uint8), q8.mT.view(torch.uint8)) and qt8.stride(1) % 16 == 0
        assert (s_rows == s_rows[:, :1]).all() and torch.equal(s_rows[:, 0], s_cols[:, 0])
    _check_scales(amax, s_rows[:, 0] if amax_B is None else pow2_scale(amax))
    assert q.abs().max() <= 448
    q2 = quantize_weight(w_BRC[0])  # 2-D: one batch entry, 2-D outputs
    assert [t.shape for t in q2] == [(R, C), (R,), (C, R), (C,)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@given(B=st.integers(1, 3), R=st.integers(1, 40), C=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_copies_of_a_quantized_weight_are_quantize_weights_and_rewrite_in_place(B, R, C, seed):
    """From q alone (an FSDP all-gather in e4m3) and the amax its scale came from: quantize_weight's
    four outputs bit for bit, in 3-D and 2-D; given earlier copies, the same storages rewritten."""
    w_BRC = _data((B, R, C), seed).mul_(2.0**-10)
    amax = w_BRC.abs().flatten(1).amax(1)
    for w, amax_B in ((w_BRC, amax), (w_BRC, amax * 0.75), (w_BRC[0], amax[:1])):
        want = quantize_weight(w, amax_B)
        got = copies_of_quantized(want[0].clone(), amax_B)
        assert all(torch.equal(_bytes(g), _bytes(t)) for g, t in zip(got[:4], want)) and got.amax is amax_B
        want3 = quantize_weight(w * 3, amax_B * 3)  # new values in the same storage, new scales
        got[0].copy_(want3[0])
        again = copies_of_quantized(got[0], amax_B * 3, got)
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(again[:4], got[:4]))
        assert all(torch.equal(_bytes(g), _bytes(t)) for g, t in zip(again[:4], want3))
        assert not torch.equal(want3[1], want[1]) and not torch.equal(_bytes(want3[0]), _bytes(want[0]))


def test_scale_edges_saturate_nothing():
    """amax exactly 448 * 2^k keeps scale 2^k (q reaches 448, not NaN); one step above doubles it;
    an all-zero row gets the smallest normal scale."""
    amax = torch.tensor([448.0, 448.0 * 2**-10, 449.0, 0.0, 1.0])
    assert pow2_scale(amax).tolist() == [1.0, 2**-10, 2.0, 2.0**-126, 2**-8]
    x_MK = torch.tensor([[448.0, -1.0], [-449.0, 3.0], [0.0, 0.0]])
    q, scale = quantize_rows(x_MK)
    assert q.float().tolist() == [[448.0, -1.0], [-224.0, 1.5], [0.0, 0.0]]
    assert scale.tolist() == [1.0, 2.0, 2.0**-126]


def test_empty_inputs():
    q, scale = quantize_rows(torch.zeros(0, 8))
    assert q.shape == (0, 8) and scale.shape == (0,)
    qc, scale = cols_from_rows(q, scale, torch.zeros(2, dtype=torch.int32))
    assert qc.shape == (8, 0) and torch.equal(scale, torch.full((2, 8), 2.0**-126))
    assert [t.shape for t in quantize_weight(torch.zeros(2, 0, 3))] == [(2, 0, 3), (2, 0), (2, 3, 0), (2, 3)]


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="x_MK: expected 2 dimensions"):
        quantize_rows(torch.zeros(4))
    with pytest.raises(ValueError, match="expected dtype"):
        quantize_rows(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="one scale per row"):
        cols_from_rows(torch.zeros(4, 6), torch.ones(3))
    with pytest.raises(ValueError, match="contiguous rows"):
        cols_from_rows(torch.zeros(6, 4).t(), torch.ones(4))
    with pytest.raises(ValueError, match="contiguous"):
        quantize_weight(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="2 or 3 dimensions"):
        quantize_weight(torch.zeros(2, 2, 2, 2))
    with pytest.raises(ValueError, match="one amax per batch entry"):
        quantize_weight(torch.zeros(2, 3, 4), torch.ones(3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape, ends",
    [
        ((3000, 2048 + 48), [0, 512, 512, 1040, 2992]),  # groups, padding rows, a partial column block
        ((16384, 528), None),  # one group
        ((131072 // 8, 768), [1024 * (i + 1) for i in range(16)]),  # expert-sized groups, one launch
    ],
)
def test_fp8_bit_exact_on_gpu(dtype, shape, ends):
    """The e4m3 casts of the compiled kernels (the interpreter's are wrong for some values), at the
    real tile sizes: rows, columns from rows (both launch paths), and a weight in both layouts."""
    x_MK = _data(shape, 1, dtype, "cuda")
    for x in (x_MK, x_MK[:, :33].repeat(1, 300)):  # K = 9900: several column steps
        q, scale = quantize_rows(x)
        ref_q, ref_scale = quantize_rows_reference(x)
        assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    q, scale = quantize_rows(x_MK)
    ends_G = torch.tensor(ends or [shape[0]], dtype=torch.int32, device="cuda")
    qc, scale_c = cols_from_rows(q, scale, ends_G if ends else None)
    ref_q, ref_scale = cols_from_rows_reference(q, scale, ends_G)
    used = int(ends_G[-1])
    assert torch.equal(scale_c, ref_scale)
    assert torch.equal(qc[:, :used].view(torch.uint8), ref_q[:, :used].view(torch.uint8))
    qc_cut, _ = cols_from_rows(q[:, 16:], scale, ends_G if ends else None)  # rows K apart
    assert torch.equal(qc_cut[:, :used].view(torch.uint8), ref_q[16:, :used].view(torch.uint8))
    w = _data((3, 768, 2048), 2, torch.float32, "cuda") * 2.0**-12
    for amax in (None, w.abs().flatten(1).amax(1) / 3):
        for got, want in zip(quantize_weight(w, amax), quantize_weight_reference(w, amax)):
            assert torch.equal(_bytes(got), _bytes(want))
        amax = w.abs().flatten(1).amax(1) if amax is None else amax
        want, want3 = quantize_weight(w, amax), quantize_weight(w * 3, amax * 3)
        got = copies_of_quantized(want[0].clone(), amax)
        assert all(torch.equal(_bytes(g), _bytes(t)) for g, t in zip(got[:4], want))
        got[0].copy_(want3[0])  # the Triton rewrite in place (an FSDP gather's refill)
        again = copies_of_quantized(got[0], amax * 3, got)
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(again[:4], got[:4]))
        assert all(torch.equal(_bytes(g), _bytes(t)) for g, t in zip(again[:4], want3))
