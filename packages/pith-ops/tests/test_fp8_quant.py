"""fp8_quant's kernels against their references (scales bit-exact, values bit-exact), and the references'
own properties in float64: power-of-two scales as small as allowed, no saturation past 448, round-trip
error within half an e4m3 step.

Shape legend: B batch, M rows, K columns, G row groups.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pith_ops import quantize_cols, quantize_cols_reference, quantize_rows, quantize_rows_reference
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
    B=st.integers(1, 3),
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    tail=st.integers(0, 5),
    K=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_quantize_cols_kernel_matches_reference_per_group_and_round_trips(B, sizes, tail, K, seed):
    ends_G = torch.tensor(sizes).cumsum(0).to(torch.int32)
    used = int(ends_G[-1])
    x_BMK = _data((B, used + tail, K), seed, torch.bfloat16)
    q, scale = quantize_cols(x_BMK, ends_G, torch.float32)
    ref_q, ref_scale = quantize_cols_reference(x_BMK, ends_G, torch.float32)
    assert q.shape == (B, K, used + tail) and scale.shape == (B, len(sizes), K)
    assert torch.equal(scale, ref_scale) and torch.equal(q[..., :used], ref_q[..., :used])
    q8, scale8 = quantize_cols(x_BMK, ends_G)
    assert torch.equal(
        q8[..., :used].view(torch.uint8),
        quantize_cols_reference(x_BMK, ends_G)[0][..., :used].view(torch.uint8),
    )
    start = 0
    for g, end in enumerate(ends_G.tolist()):
        if end > start:
            _check_scales(x_BMK[:, start:end].float().abs().amax(1), scale8[:, g])
        start = end
    deq = dequantize_cols(q8, scale8, ends_G)[..., :used]
    scale_BKM = scale8.transpose(1, 2).repeat_interleave(torch.tensor(sizes), dim=2)
    _check_round_trip(x_BMK[:, :used].mT, deq, scale_BKM)


@pytest.mark.parametrize("ends", [[16, 48, 48, 80], [16, 40, 64]])
def test_quantize_cols_16_row_groups_match_reference(ends):
    """Groups on 16-row boundaries (the FP8 GEMMs'), whole tiles and longer, take the kernel's 16-byte
    store path; a group ending off the boundary makes the tiles after it take the other one."""
    ends_G = torch.tensor(ends, dtype=torch.int32)
    x_BMK = _data((2, ends[-1] + 5, 24), 3)
    q, scale = quantize_cols(x_BMK, ends_G, torch.float32)
    ref_q, ref_scale = quantize_cols_reference(x_BMK, ends_G, torch.float32)
    assert torch.equal(scale, ref_scale) and torch.equal(q[..., : ends[-1]], ref_q[..., : ends[-1]])


def test_2d_input_is_one_batch_entry_of_one_group():
    x_MK = _data((33, 20), 0)
    q, scale = quantize_cols(x_MK)
    ref_q, ref_scale = quantize_cols_reference(x_MK[None], torch.tensor([33], dtype=torch.int32))
    assert q.shape == (20, 33) and scale.shape == (1, 20) and q.stride() == (48, 1)  # 16-byte rows
    assert torch.equal(scale, ref_scale[0]) and torch.equal(q.view(torch.uint8), ref_q[0].view(torch.uint8))


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
    q, scale = quantize_cols(torch.zeros(0, 8), torch.zeros(2, dtype=torch.int32))
    assert q.shape == (8, 0) and torch.equal(scale, torch.full((2, 8), 2.0**-126))


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="x_MK: expected 2 dimensions"):
        quantize_rows(torch.zeros(4))
    with pytest.raises(ValueError, match="expected dtype"):
        quantize_rows(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        quantize_cols(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="2 or 3 dimensions"):
        quantize_cols(torch.zeros(2, 2, 2, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape, ends",
    [
        ((1, 3000, 2048 + 48), [0, 512, 512, 1040, 2992]),  # groups within one strip tile, padding rows
        ((1, 5000, 528), [1000, 4900]),  # a group longer than a tile: atomic scales, then FINISH
        ((3, 768, 2048), None),  # a batch of expert weights, one launch
    ],
)
def test_fp8_bit_exact_on_gpu(dtype, shape, ends):
    """The e4m3 casts of the compiled kernels (the interpreter's are wrong for some values), at tiles
    of the real sizes: rows in one load (and looping past ROWS_MAX_K), column strips of 2048 rows."""
    x_BMK = _data(shape, 1, dtype, "cuda")
    for x_MK in (x_BMK.flatten(0, 1), x_BMK[0, :, :33].repeat(1, 300)):  # K = 9900 > ROWS_MAX_K
        q, scale = quantize_rows(x_MK)
        ref_q, ref_scale = quantize_rows_reference(x_MK)
        assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    ends_G = torch.tensor(ends or [shape[1]], dtype=torch.int32, device="cuda")
    q, scale = quantize_cols(x_BMK, ends_G if ends else None)
    ref_q, ref_scale = quantize_cols_reference(x_BMK, ends_G)
    used = int(ends_G[-1])
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q[..., :used].view(torch.uint8), ref_q[..., :used].view(torch.uint8))
