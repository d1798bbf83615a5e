"""The FP8 blockwise recipe's reference (megatron_mok/quantization.py) against its definition
(docs/design.md §12.1): exact properties of q and the scales, and the GEMM against dequantized fp32."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import quantization as fq
from megatron_mok.limits import FP8_BLOCK, fp8_scale_rows
from oracle import assert_close_reordered_sum, sqnr_db


def _rows(r: int, c: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(r, c, generator=g) * torch.rand(r, 1, generator=g) * 10).to(torch.bfloat16)


@pytest.mark.parametrize("pow2", [False, True])
def test_rowwise_block_max_maps_to_e4m3_max_or_below(pow2):
    x = _rows(5, 3 * FP8_BLOCK)
    q, scale = fq.quantize_rowwise(x, pow2)
    blocks = q.float().reshape(5, 3, FP8_BLOCK).abs().amax(-1)
    if pow2:
        # A power-of-two scale >= amax / 448: the block maximum lands in (224, 448], and E4M3 rounds
        # values just above 224 down to 224 (its step there is 16).
        assert torch.all((blocks >= 224) & (blocks <= 448))
        mantissa, _ = torch.frexp(scale)
        assert torch.all(mantissa == 0.5), "pow2 scales must be powers of two"
    else:
        # amax / (amax / 448) is 448 up to one fp32 rounding of the division, and E4M3 rounds it to 448.
        assert torch.all(blocks == 448)


def test_block_scale_is_the_ieee_quotient():
    """scale = amax / 448 rounded once to fp32 (docs/design.md §12.1), the quotient kernels compute
    with IEEE division. The float64 quotient rounded to fp32 is that quotient (53 >= 2 * 24 + 2 bits:
    double rounding of a quotient is innocuous). Half of these amax values tell it apart from
    amax * fp32(1 / 448), which is what torch computes for `cuda_tensor / 448`."""
    g = torch.Generator().manual_seed(6)
    amax = torch.cat([
        torch.randn(4096, generator=g).abs().bfloat16().float(),
        (torch.rand(1024, generator=g) * 2.0**-130).clamp(min=2.0**-149),  # bf16's subnormal range: the scale is subnormal too
        torch.rand(1024, generator=g) * 3e38,
    ])
    want = (amax.double() / 448).float()
    assert torch.equal(fq.block_scale(amax), want)
    reciprocal = amax * torch.tensor(1 / 448, dtype=torch.float32)
    assert (reciprocal != want).sum() > 1000, "these amax values must tell division from the reciprocal's product"


def test_pow2_scale_is_the_smallest_power_of_two_at_least_the_quotient():
    """The bit-built power of two (exact on every device) against float64 arithmetic on the IEEE
    quotient: amax values across fp32's range, subnormal quotients included, and quotients that are
    powers of two themselves (kept), or one ulp either side of one."""
    g = torch.Generator().manual_seed(7)
    powers = 448 * 2.0 ** torch.arange(-140, 118, dtype=torch.float64)  # amax / 448 = 2^k exactly
    amax = torch.cat([
        torch.randn(4096, generator=g).abs().bfloat16().float(),
        (torch.rand(1024, generator=g) * 2.0**-130).clamp(min=2.0**-149),
        torch.rand(1024, generator=g) * 3e38,
        powers.float(),
        torch.nextafter(powers.float(), torch.tensor(0.0)),
        torch.nextafter(powers.float(), torch.tensor(float("inf"))),
    ])
    quotient = (amax.double() / 448).float().double()
    want = 2.0 ** torch.ceil(torch.log2(quotient))  # exact in float64 for these powers of two
    want = torch.where(quotient == 0, 2.0**-149, want)  # amax / 448 underflowed: the least subnormal
    got = fq.block_scale(amax, pow2=True)
    assert torch.equal(got.double(), want), f"first miss at amax {float(amax[(got.double() != want).nonzero()[0]]):.9g}"
    special = torch.tensor([0.0, float("inf"), float("nan")])
    s = fq.block_scale(special, pow2=True)
    assert s[0] == 1 and torch.isinf(s[1]) and torch.isnan(s[2])


def test_rowwise_reconstructs_within_e4m3_precision():
    x = _rows(7, 2 * FP8_BLOCK, seed=1)
    q, scale = fq.quantize_rowwise(x)
    back = fq.dequantize_rowwise(q, scale)
    # E4M3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normal values; values
    # below E4M3's smallest normal (2^-6 * scale) are within half a subnormal step (2^-10 * scale).
    err = (back - x.float()).abs()
    bound = torch.maximum(x.float().abs() * 2**-4, scale.repeat_interleave(FP8_BLOCK, 1) * 2**-10)
    assert torch.all(err <= bound)


def test_all_zero_block_quantizes_to_zeros_scale_one():
    x = torch.zeros(2, 2 * FP8_BLOCK, dtype=torch.bfloat16)
    x[1, FP8_BLOCK:] = 1.0
    q, scale = fq.quantize_rowwise(x)
    assert torch.equal(q[0].float(), torch.zeros(2 * FP8_BLOCK)) and torch.equal(scale[0], torch.ones(2))
    assert torch.equal(q[1, :FP8_BLOCK].float(), torch.zeros(FP8_BLOCK)) and scale[1, 0] == 1
    assert not torch.isnan(q.float()).any()


@pytest.mark.parametrize("pow2", [False, True])
def test_block_whose_scale_underflows_quantizes_finitely(pow2):
    """fp32 blocks whose amax / 448 underflows to 0 (amax below ~3.1e-43): scale 2^-149, fp32's least
    subnormal, and each value its multiple of 2^-149 rounded to E4M3; never 0 / 0 = NaN or a 448 of a
    zero scale. A block with amax just above the underflow keeps amax / 448."""
    x = torch.zeros(3, 2 * FP8_BLOCK, dtype=torch.float32)
    x[0, 5] = 1e-44  # 7 * 2^-149
    x[1, :FP8_BLOCK] = -(2.0**-145)  # 16 * 2^-149
    x[1, 3] = 0.0
    x[2, FP8_BLOCK:] = 2.0**-140
    x[2, FP8_BLOCK + 1] = 2.0**-149 * 3000  # the block's amax: amax / 448 ~ 6.7 * 2^-149, subnormal, kept
    q, scale = fq.quantize_rowwise(x, pow2)
    assert not torch.isnan(q.float()).any() and torch.isfinite(scale).all()
    tiny = torch.tensor(2.0**-149)
    assert scale[0, 0] == tiny and q[0, 5].float() == 7 and (q[0, :5].float() == 0).all()
    assert scale[1, 0] == tiny and (q[1, :FP8_BLOCK].float() == torch.where(torch.arange(FP8_BLOCK) == 3, 0.0, -16.0)).all()
    assert scale[0, 1] == 1 and scale[1, 1] == 1 and scale[2, 0] == 1  # all-zero blocks
    want = fq.block_scale(torch.tensor([2.0**-149 * 3000]), pow2)
    assert scale[2, 1] == want and want > tiny
    back = fq.dequantize_rowwise(q, scale)
    assert back[0, 5] == 7 * tiny and back[1, 0] == -16 * tiny


def test_non_finite_value_makes_its_block_scale_non_finite():
    x = _rows(2, 2 * FP8_BLOCK)
    x[0, 3] = float("nan")
    x[1, FP8_BLOCK + 1] = float("inf")
    _, scale = fq.quantize_rowwise(x)
    assert torch.isnan(scale[0, 0]) and torch.isinf(scale[1, 1])
    assert torch.isfinite(scale[0, 1]) and torch.isfinite(scale[1, 0])


def test_weight_transpose_is_the_quantization_of_the_transposed_weight():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 2 * FP8_BLOCK, 3 * FP8_BLOCK, generator=g).to(torch.bfloat16)
    q, s = fq.quantize_weight(w)
    qt, st = fq.transpose_weight(q, s)
    q2, s2 = fq.quantize_weight(w.transpose(1, 2).contiguous())
    assert torch.equal(qt.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(st, s2)
    # Each 128x128 tile's scale is its own max / 448.
    tile = w[1, FP8_BLOCK:, 2 * FP8_BLOCK :].float()
    assert s[1, 1, 2] == tile.abs().max() / 448


def test_columnwise_is_rowwise_of_the_transpose():
    x = _rows(2 * FP8_BLOCK, 3 * FP8_BLOCK, seed=3)
    q, s = fq.quantize_columnwise(x)
    qr, sr = fq.quantize_rowwise(x.t().contiguous())
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr.t())


def test_gemm_a_scales_layout():
    s = torch.rand(5, 3)
    a = fq.gemm_a_scales(s)
    assert a.shape == (3, fp8_scale_rows(5)) and torch.equal(a[:, :5], s.t())


def test_segment_matmul_equals_dequantized_fp32():
    g = torch.Generator().manual_seed(4)
    rows, k, n, experts = 300, 2 * FP8_BLOCK, FP8_BLOCK, 3
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(experts, n, k, generator=g).to(torch.bfloat16)
    offsets = torch.tensor([0, 100, 100, 290])
    qa, sa = fq.quantize_rowwise(x)
    qw, sw = fq.quantize_weight(w)
    got = fq.fp8_segment_matmul(qa, fq.gemm_a_scales(sa), qw, sw, offsets)
    deq_a, deq_w = fq.dequantize_rowwise(qa, sa), fq.dequantize_weight(qw, sw)
    want = torch.zeros(rows, n, dtype=torch.float64)
    abs_sum = torch.zeros(rows, n, dtype=torch.float64)
    for e in range(experts):
        b, end = int(offsets[e]), int(offsets[e + 1])
        want[b:end] = deq_a[b:end].double().matmul(deq_w[e].double().t())
        abs_sum[b:end] = deq_a[b:end].double().abs().matmul(deq_w[e].double().abs().t())
    # The same K = 256 products summed in fp32 in another order, against the exact sum (scheme 2).
    assert_close_reordered_sum(got[:290], want[:290], abs_sum[:290], k, sides=1, msg="fp8 segment matmul")
    assert torch.all(got[290:] == 0)
    # The recipe against the unquantized fp32 GEMM: one FP8 GEMM is ~26 dB on Gaussian data.
    exact = torch.zeros(rows, n)
    for e in range(experts):
        b, end = int(offsets[e]), int(offsets[e + 1])
        exact[b:end] = x[b:end].float() @ w[e].float().t()
    assert sqnr_db(got[:290], exact[:290]) > 25


def test_weight_grad_equals_dequantized_fp32():
    g = torch.Generator().manual_seed(5)
    rows, n, k = 3 * FP8_BLOCK, FP8_BLOCK, 2 * FP8_BLOCK
    dy = torch.randn(rows, n, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    offsets = torch.tensor([0, FP8_BLOCK, FP8_BLOCK, 3 * FP8_BLOCK - 10])
    dy[3 * FP8_BLOCK - 10 :] = 0
    x[3 * FP8_BLOCK - 10 :] = 0
    qg, sg = fq.quantize_columnwise(dy)
    qx, sx = fq.quantize_columnwise(x)
    got = fq.fp8_segment_weight_grad(qg, sg, qx, sx, offsets)
    deq_g = (qg.float().reshape(n, -1, FP8_BLOCK) * sg.t().unsqueeze(-1)).reshape(n, rows)
    deq_x = (qx.float().reshape(k, -1, FP8_BLOCK) * sx.t().unsqueeze(-1)).reshape(k, rows)
    assert torch.all(got[1] == 0)
    for e, (b, end) in ((0, (0, FP8_BLOCK)), (2, (FP8_BLOCK, 3 * FP8_BLOCK))):
        g_e, x_e = deq_g[:, b:end].double(), deq_x[:, b:end].double()
        # The segment's products summed in fp32 in another order, against the exact sum (scheme 2).
        assert_close_reordered_sum(got[e], g_e @ x_e.t(), g_e.abs() @ x_e.abs().t(), end - b, sides=1, msg=f"expert {e}")


@pytest.mark.parametrize("fn, shape, name", [
    (fq.quantize_rowwise, (4, 100), "columns"),
    (fq.quantize_columnwise, (100, 128), "rows"),
])
def test_not_a_multiple_of_128_is_a_value_error(fn, shape, name):
    with pytest.raises(ValueError, match=f"{name}.*multiple of 128"):
        fn(torch.zeros(shape))


def test_weight_not_a_multiple_of_128_is_a_value_error():
    with pytest.raises(ValueError, match=r"\(K\) must be a multiple of 128"):
        fq.quantize_weight(torch.zeros(1, 128, 96))


def test_block_products_are_exact():
    """A 128-block's sum of E4M3 products is exact in float64 in any order (quantization.py's
    docstring): the largest products (448 * 448) mixed with the smallest (2^-9 * 2^-9) sum to the same
    value forwards and backwards, and to the exact rational sum."""
    from fractions import Fraction

    values = torch.tensor([448.0, -448.0, 2.0**-9, 448.0, -2.0**-9, 3 * 2.0**-9] * 21 + [448.0, 2.0**-9])
    a = values.to(fq.E4M3)
    assert torch.equal(a.float(), values), "the values must be E4M3 values"
    forwards = torch.dot(a.double(), a.double())
    backwards = torch.dot(a.double().flip(0), a.double().flip(0))
    exact = sum(Fraction(float(v)) ** 2 for v in values)
    assert forwards == backwards and Fraction(float(forwards)) == exact


ALIGNED_OFFSETS = {
    "two_experts": [0, 128, 384],
    "empty_first": [0, 0, 256, 384],
    "empty_last": [0, 256, 256],
    "past_the_end": [0, 128, 128],  # the last 256 rows belong to no expert
}


# fq._GATHER_BYTES: the default (every K block and tile in one batch at these sizes), and 1 (one
# K block and one tile per batch): the batching changes which launches compute a product, never it.
GATHER_BYTES = {"one_batch": None, "a_block_a_batch": 1}


@pytest.mark.parametrize("gather", list(GATHER_BYTES))
@pytest.mark.parametrize("offsets", list(ALIGNED_OFFSETS))
def test_grouped_matmul_is_bitwise_the_segment_matmul(offsets, gather, monkeypatch):
    """The layer's sync-free grouped GEMM against the per-segment reference on 128-aligned segments:
    the same exact block products promoted in the same order, so the same bits."""
    if GATHER_BYTES[gather] is not None:
        monkeypatch.setattr(fq, "_GATHER_BYTES", GATHER_BYTES[gather])
    bounds = torch.tensor(ALIGNED_OFFSETS[offsets])
    rows, k, n = 384 + 5, 3 * FP8_BLOCK, 2 * FP8_BLOCK  # (rows past a 128-multiple: a partial tile)
    qa, sa = fq.quantize_rowwise(_rows(rows, k, seed=6))
    g = torch.Generator().manual_seed(7)
    qw, sw = fq.quantize_weight(torch.randn(len(bounds) - 1, n, k, generator=g).to(torch.bfloat16))
    got = fq.fp8_grouped_matmul(qa, sa, qw, sw, bounds)
    want = fq.fp8_segment_matmul(qa, fq.gemm_a_scales(sa), qw, sw, bounds)
    assert torch.equal(got, want)
    assert bool((got[int(bounds[-1]):] == 0).all())


@pytest.mark.parametrize("gather", list(GATHER_BYTES))
def test_grouped_weight_grad_windows_are_bitwise_one_pass(gather, monkeypatch):
    """fp8_grouped_weight_grad over a schedule at once, window by window (windows at multiples of 128
    rows, offsets relative and clamped as receive.windows makes them), and fp8_segment_weight_grad:
    the same additions in the same order, the same bits."""
    if GATHER_BYTES[gather] is not None:
        monkeypatch.setattr(fq, "_GATHER_BYTES", GATHER_BYTES[gather])
    rows, n, k = 5 * FP8_BLOCK, FP8_BLOCK, 2 * FP8_BLOCK
    offsets = torch.tensor([0, 2 * FP8_BLOCK, 2 * FP8_BLOCK, 4 * FP8_BLOCK])  # rows past 512: none
    qg, sg = fq.quantize_columnwise(_rows(rows, n, seed=8))
    qx, sx = fq.quantize_columnwise(_rows(rows, k, seed=9))
    whole = torch.zeros(4, n, k)
    fq.fp8_grouped_weight_grad(qg, sg, qx, sx, offsets, whole)
    assert torch.equal(whole[:3], fq.fp8_segment_weight_grad(qg, sg, qx, sx, offsets))
    windowed = torch.zeros(4, n, k)
    window = 2 * FP8_BLOCK
    for begin in range(0, rows, window):
        cols = slice(begin, begin + window)
        blocks = slice(begin // FP8_BLOCK, (begin + window) // FP8_BLOCK)
        local = (offsets - begin).clamp(0, window)
        fq.fp8_grouped_weight_grad(qg[:, cols], sg[blocks], qx[:, cols], sx[blocks], local, windowed)
    assert torch.equal(windowed, whole)


def test_quantized_rows_gather_zeroes_invalid_rows_and_scales_by_the_factor():
    qr = fq.QuantizedRows.quantize(_rows(4, 2 * FP8_BLOCK, seed=10))
    index = torch.tensor([2, 0, 3])
    valid = torch.tensor([True, False, True])
    factor = torch.tensor([0.5, 7.0, 2.0])
    got = qr.gather(index, valid, factor)
    assert torch.equal(got.values[0].view(torch.uint8), qr.values[2].view(torch.uint8))
    assert torch.equal(got.values[1].view(torch.uint8), torch.zeros(2 * FP8_BLOCK, dtype=torch.uint8))
    assert torch.equal(got.scales[1], torch.ones(2)), "an invalid row is an all-zero block, scale 1"
    assert torch.equal(got.scales[2], qr.scales[3] * 2.0)
