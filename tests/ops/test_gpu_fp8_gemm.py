"""The FP8 blockwise grouped GEMM (ops.fp8_expert_gemm, csrc/gemm/fp8_gemm_sm90.cuh) against the exact
recipe (quantization.fp8_segment_matmul through ops.fp8_expert_gemm_reference) on the same quantized
inputs, and against fp32 of the unquantized inputs (skipped without a Hopper GPU and the built
extension; run on the device).

Tolerances (SQNR = 20 log10(||ref|| / ||ref - got||)):
- Against the exact recipe, >= 45 dB (the issue's bar is 35). The kernel computes the same products:
  E4M3 x E4M3 is exact in the tensor cores as in fp32, the scales multiply in fp32 as in the
  reference. What differs: the bf16 rounding of the output (the reference is fp32; on Gaussian data
  that rounding alone is 55.5 dB), the tensor cores' accumulation of a 128-K block (Hopper aligns
  the products of an FP8 MMA to ~14 bits: DeepSeek-V3 §3.3.2), and fp32 summation order. The last
  two are far below the first (relative ~2^-13 per block partial), so 45 dB leaves 10 dB of margin
  while a wrong scale, block, row or column costs far more (a single wrong K block of 56 is ~35 dB).
- Per element against the exact recipe: |got - ref| <= 2^-8 |ref| + 2^-7 S, S = sum over blocks of
  |sa sb| sum over the block of |qa qb| (the reference evaluated on |q|). 2^-8 |ref| is one bf16
  rounding; a block's partial goes through at most 36 alignments in the tensor cores (32 products
  of one k32 MMA, 4 MMAs), each losing less than 2^-13 of the block's sum of magnitudes: < 2^-7.8 S.
  No row or column may break it (catches an outlier the norm would average away).
- Against fp32 of the unquantized inputs, >= 25 dB: the recipe itself costs accuracy (both operands
  rounded to E4M3, ~2^-4 relative each); on Gaussian data it gives ~28.7 dB (the issue's bar).
- The mainloop variants (ops.fp8_gemm.FP8_GEMM_VARIANTS): torch.equal to the default's output. They
  issue the same wgmmas into a fresh fp32 partial per K block and promote with the same fmaf in the
  same order, so any difference is a bug (a partial read before its wgmmas completed, a stage
  released early, a wrong scale); exactness, not a tolerance, is what can catch a rare race.
- The push epilogue (ops.fp8_expert_gemm_push): every rank's combine region torch.equal (as bytes)
  to what ops.push_rows makes of ops.fp8_expert_gemm's rows: the same product rounded the same way,
  moved to the same slots; a slot no row routes to keeps its sentinel.
- The SwiGLU epilogue: gate_up as above; act and its scales exactly quantization.quantize_rowwise of
  ops.swiglu_forward(gate_up) (the same bf16 act, amax, IEEE division and round-to-nearest E4M3);
  the dequantized act against SwiGLU of the fp32 unquantized product >= 20 dB (gate and up each
  ~28.7 dB, their product ~25.5 dB, act's own E4M3 rounding on top: ~24.7 dB on Gaussian data in
  the PyTorch emulation of the recipe).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_mok import ops, quantization
from megatron_mok.limits import fp8_scale_rows
from megatron_mok.backends.tuning import FP8_EXPERT_GEMM_CLUSTER_M, FP8_EXPERT_GEMM_GROUP_M
from megatron_mok.ops.fp8_gemm import (FP8_GEMM_VARIANTS, FP8_PUSH_GEMM_VARIANTS, FP8_SWIGLU_BACKWARD_GEMM_VARIANTS,
                                       FP8_SWIGLU_GEMM_VARIANTS)
from cuda_checks import NEEDS_HOPPER_KERNELS, poison_allocator

pytestmark = NEEDS_HOPPER_KERNELS

E4M3 = torch.float8_e4m3fn
LAUNCH = (FP8_EXPERT_GEMM_CLUSTER_M, FP8_EXPERT_GEMM_GROUP_M)
MIN_SQNR_VS_RECIPE_DB = 45.0
MIN_SQNR_VS_FP32_DB = 25.0
MIN_SQNR_ACT_VS_FP32_DB = 20.0

# name: (rows per expert, K, N, segments padded to 128 rows with zero rows, weight transposed for dgrad)
# The model shapes are one rank's experts' GEMMs (docs/design.md §12.4): DeepSeek-V3 H 7168, F 2048
# (fc1 2F 4096 x H; fc2 H x F; the dgrads take the transposed copies), Qwen3-30B H 2048, F 768.
CASES = {
    "minimum": ([1], 128, 128, False, False),
    "one_tile": ([128], 128, 128, True, False),
    "deepseek_v3_fc1": ([700, 300, 0, 1100], 7168, 4096, True, False),
    "deepseek_v3_fc2": ([700, 300, 0, 1100], 2048, 7168, True, False),
    "deepseek_v3_dgrad_fc1": ([700, 300, 0, 1100], 4096, 7168, True, True),
    "deepseek_v3_dgrad_fc2": ([257, 0, 1023], 7168, 2048, True, True),
    "qwen3_30b_fc1": ([40, 0, 300, 7] * 8, 2048, 1536, True, False),
    "qwen3_30b_fc2": ([40, 0, 300, 7] * 8, 768, 2048, True, False),
    "qwen3_30b_dgrad_fc1": ([40, 0, 300, 7] * 8, 1536, 2048, True, True),
    "empty_experts": ([0, 0, 300, 0], 256, 384, True, False),
    "all_rows_one_expert": ([0, 1000, 0], 384, 256, True, False),
    "odd_segments_padded": ([1, 129, 77, 255, 3], 640, 640, True, False),
    # Not the recipe's layout, but the kernel's contract: a tile's rows past its segment are
    # computed from the next segment's and not stored.
    "odd_segments_unpadded": ([37, 0, 129, 5, 200], 256, 256, False, False),
    "many_small_experts": ([3, 17, 0, 64, 65, 127, 128, 1, 0, 250] * 4, 256, 128, True, False),
}


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(20 * torch.log10(ref.norm() / (ref - got).norm()))


def make_case(rows_per_expert, k, n, padded, transposed, seed, tail_rows=3):
    """Quantized operands of one case: x (R, K) with zero padding rows, the weight quantized 128 x 128
    (for dgrad: quantized as (E, K, N), then its transposed copy (E, N, K)), offsets, and the fp32
    unquantized product per segment."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sizes = [-(-r // 128) * 128 if padded else r for r in rows_per_expert]
    offsets_host = [0]
    for size in sizes:
        offsets_host.append(offsets_host[-1] + size)
    num_rows = offsets_host[-1] + tail_rows  # rows past the last segment: never written
    x = torch.randn(num_rows, k, device="cuda", generator=gen)
    for e, rows in enumerate(rows_per_expert):  # the padding rows of a segment are zero
        x[offsets_host[e] + rows : offsets_host[e + 1]] = 0
    experts = len(rows_per_expert)
    if transposed:
        stored = torch.randn(experts, k, n, device="cuda", generator=gen) / k**0.5  # (E, K, N) as stored
        qw, sw = quantization.transpose_weight(*quantization.quantize_weight(stored))
        w = stored.transpose(1, 2)
    else:
        w = torch.randn(experts, n, k, device="cuda", generator=gen) / k**0.5
        qw, sw = quantization.quantize_weight(w)
    qa, sa_rows = quantization.quantize_rowwise(x)
    offsets = torch.tensor(offsets_host, dtype=torch.int32, device="cuda")
    fp32 = torch.zeros(offsets_host[-1], n, device="cuda")
    for e in range(experts):
        lo, hi = offsets_host[e], offsets_host[e + 1]
        fp32[lo:hi] = x[lo:hi] @ w[e].T
    return (qa, quantization.gemm_a_scales(sa_rows), qw, sw, offsets), fp32, offsets_host[-1]


def case_args(name):
    rows, k, n, padded, transposed = CASES[name]
    return make_case(rows, k, n, padded, transposed, seed=zlib.crc32(name.encode()) % 1000)


def assert_matches_recipe_and_fp32(got, args, fp32, end):
    """got (>= end rows, N) bf16 against the exact recipe and fp32 (module doc)."""
    qa, sa, qw, sw, offsets = args
    got = got[:end].float()
    assert torch.isfinite(got).all(), "non-finite (unwritten) elements inside the segments"
    ref = ops.fp8_expert_gemm_reference(*args)[:end]
    magnitude = ops.fp8_expert_gemm_reference(qa.float().abs().to(E4M3), sa, qw.float().abs().to(E4M3), sw, offsets)
    excess = (got - ref).abs() - (2.0**-8 * ref.abs() + 2.0**-7 * magnitude[:end])
    worst = int(excess.argmax())
    assert excess.max() <= 0, f"element {divmod(worst, ref.shape[1])} off by {float(excess.max()):.3e} past its bound"
    if ref.norm() > 0:
        assert sqnr_db(ref, got) >= MIN_SQNR_VS_RECIPE_DB
        assert sqnr_db(fp32, got) >= MIN_SQNR_VS_FP32_DB


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_expert_gemm_matches_the_recipe_and_fp32(case, cluster_m):
    args, fp32, end = case_args(case)
    qa, _, qw, _, _ = args
    poison_allocator()
    out = ops.fp8_expert_gemm(*args, cluster_m, FP8_EXPERT_GEMM_GROUP_M)
    assert out.shape == (qa.shape[0], qw.shape[1]) and out.dtype == torch.bfloat16
    assert_matches_recipe_and_fp32(out, args, fp32, end)


@pytest.mark.parametrize("variant", FP8_GEMM_VARIANTS[1:])
@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_variants_equal_the_default_bitwise(case, cluster_m, variant):
    """Every shape of CASES (K of 1, 2, 3, 5, 6, 12, 16, 32 and 56 blocks: each tail of a mainloop
    that works on two K blocks at a time; one and many tiles per CTA) against the default
    mainloop's output on the same inputs, bit for bit (module doc). The default is held to the
    recipe by test_fp8_expert_gemm_matches_the_recipe_and_fp32."""
    args, _, end = case_args(case)
    want = ops.fp8_expert_gemm(*args, cluster_m, FP8_EXPERT_GEMM_GROUP_M)[:end]
    poison_allocator()
    got = ops.fp8_expert_gemm(*args, cluster_m, FP8_EXPERT_GEMM_GROUP_M, variant=variant)
    assert got.shape == (args[0].shape[0], args[2].shape[1]) and got.dtype == torch.bfloat16
    assert torch.equal(got[:end], want)


@pytest.mark.parametrize("variant", FP8_GEMM_VARIANTS)
@pytest.mark.parametrize("case", ["minimum", "odd_segments_unpadded", "qwen3_30b_fc2"])
def test_variants_never_read_the_a_scales_padding_into_a_stored_row(case, variant):
    """a_scales' columns past R (fp8_scale_rows' padding, 1 as gemm_a_scales makes them) set to NaN:
    every variant's stored rows are the clean inputs' default output bit for bit, so no mainloop
    multiplies a stored row by a padding scale. (minimum: 4 rows, no padding; the others: 374 and
    5123 rows, padded to 376 and 5124.)"""
    args, _, end = case_args(case)
    want = ops.fp8_expert_gemm(*args, *LAUNCH)[:end]
    qa, sa, qw, sw, offsets = args
    poisoned = sa.clone()
    poisoned[:, qa.shape[0]:] = float("nan")
    got = ops.fp8_expert_gemm(qa, poisoned, qw, sw, offsets, *LAUNCH, variant=variant)[:end]
    assert torch.equal(got, want)


def test_kernel_knows_every_variant_name():
    """The op's variant index covers FP8_GEMM_VARIANTS and no more (the kernel's Fp8Mainloop count)."""
    args, _, end = case_args("one_tile")
    want = ops.fp8_expert_gemm(*args, *LAUNCH)[:end]
    for index in range(len(FP8_GEMM_VARIANTS)):
        assert torch.equal(torch.ops.megatron_mok.fp8_expert_gemm(*args, *LAUNCH, index)[:end], want)
    for index in (-1, len(FP8_GEMM_VARIANTS)):
        with pytest.raises(RuntimeError, match="variant must be in"):
            torch.ops.megatron_mok.fp8_expert_gemm(*args, *LAUNCH, index)


# name: (rows per expert, K = H, 2F): gate/up projections (F a multiple of 128).
SWIGLU_CASES = {
    "minimum": ([1], 128, 256),
    "deepseek_v3_fc1": ([700, 300, 0, 1100], 7168, 4096),
    "qwen3_30b_fc1": ([40, 0, 300, 7] * 8, 2048, 1536),
    "odd_segments_padded": ([1, 129, 77, 255, 3], 384, 768),
    "odd_segments_unpadded": ([37, 0, 129, 5, 200], 256, 512),
}


def assert_registered_without_mutation(op, args):
    """The fake impl agrees with the kernel (opcheck's test_faketensor), and the op leaves every
    input's bytes as they were: what opcheck's test_schema checks, done by hand because its
    comparison multiplies the inputs, which torch has no CUDA kernel for on float8_e4m3fn."""
    before = [a.view(torch.uint8).clone() if a.dtype == E4M3 else a.clone() for a in args if isinstance(a, torch.Tensor)]
    torch.library.opcheck(op, args, test_utils=("test_faketensor",))
    op(*args)
    after = [a.view(torch.uint8) if a.dtype == E4M3 else a for a in args if isinstance(a, torch.Tensor)]
    for index, (was, now) in enumerate(zip(before, after)):
        assert torch.equal(was, now), f"{op}: tensor argument {index} was written"


# The reference side of this comparison runs quantization.quantize_rowwise on the GPU: its scale must be
# the IEEE quotient amax / 448 as the epilogue's is (quantization.block_scale divides by a tensor, see
# there), and its act the SwiGLU kernel's, whose arithmetic the epilogue shares (common/swiglu_math.cuh).
@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("case", list(SWIGLU_CASES))
def test_fp8_expert_gemm_swiglu_quantizes_act_exactly(case, cluster_m):
    rows_per_expert, k, two_ffn = SWIGLU_CASES[case]
    padded = case != "odd_segments_unpadded"
    args, fp32, end = make_case(rows_per_expert, k, two_ffn, padded, False, seed=zlib.crc32(case.encode()) % 1000 + 1)
    qa, _, _, _, offsets = args
    rows, ffn = qa.shape[0], two_ffn // 2
    poison_allocator()
    gate_up, act, act_scales = ops.fp8_expert_gemm_swiglu(*args, cluster_m, FP8_EXPERT_GEMM_GROUP_M)
    assert gate_up.shape == (rows, two_ffn) and gate_up.dtype == torch.bfloat16
    assert act.shape == (rows, ffn) and act.dtype == E4M3
    assert act_scales.shape == (ffn // 128, fp8_scale_rows(rows)) and act_scales.dtype == torch.float32
    assert_matches_recipe_and_fp32(gate_up, args, fp32, end)
    act_bf16 = ops.swiglu_forward(gate_up, offsets)[:end]
    want_q, want_scales = quantization.quantize_rowwise(act_bf16)
    # Scales first: a scale one ulp off changes only a few bytes of its block, so the scale is the
    # telling comparison.
    wrong_scales = int((act_scales[:, :end] != want_scales.t()).sum())
    assert wrong_scales == 0, f"{wrong_scales} of {want_scales.numel()} act scales differ from quantize_rowwise's"
    wrong_bytes = int((act[:end].view(torch.uint8) != want_q.view(torch.uint8)).sum())
    assert wrong_bytes == 0, f"{wrong_bytes} of {want_q.numel()} act bytes differ from quantize_rowwise's"
    assert torch.equal(act_scales[:, rows:], torch.ones_like(act_scales[:, rows:]))  # the layout's padding
    # The other place act can be quantized (tuning.FP8_ACT_QUANTIZE): the SwiGLU quantization kernel
    # on this gate_up writes the epilogue's bytes and scales.
    act_k, act_scales_k = ops.fp8_quantize_swiglu(gate_up, offsets)
    assert torch.equal(act_k[:end].view(torch.uint8), act[:end].view(torch.uint8))
    assert torch.equal(act_scales_k[:, :end], act_scales[:, :end])
    gate, up = fp32.chunk(2, dim=-1)
    act_fp32 = torch.nn.functional.silu(gate) * up
    assert sqnr_db(act_fp32, quantization.dequantize_rowwise(act[:end], act_scales[:, :end].t())) >= MIN_SQNR_ACT_VS_FP32_DB


@pytest.mark.parametrize("variant", FP8_SWIGLU_GEMM_VARIANTS[1:])
@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("case", list(SWIGLU_CASES))
def test_swiglu_variants_equal_the_default_bitwise(case, cluster_m, variant):
    """The SwiGLU-epilogue GEMM in each mainloop against the default mainloop's three outputs, bit for
    bit (the default is held to the recipe by test_fp8_expert_gemm_swiglu_quantizes_act_exactly):
    its two passes per tile (gate, then up) each run the variant's K loop."""
    rows_per_expert, k, two_ffn = SWIGLU_CASES[case]
    padded = case != "odd_segments_unpadded"
    args, _, end = make_case(rows_per_expert, k, two_ffn, padded, False, seed=zlib.crc32(case.encode()) % 1000 + 2)
    rows = args[0].shape[0]
    want = [t.clone() for t in ops.fp8_expert_gemm_swiglu(*args, cluster_m, FP8_EXPERT_GEMM_GROUP_M)]
    poison_allocator()
    got = ops.fp8_expert_gemm_swiglu(*args, cluster_m, FP8_EXPERT_GEMM_GROUP_M, variant=variant)
    assert torch.equal(got[0][:end], want[0][:end]), "gate_up"
    assert torch.equal(got[1][:end].view(torch.uint8), want[1][:end].view(torch.uint8)), "act"
    assert torch.equal(got[2][:, :end], want[2][:, :end]), "act scales"
    assert torch.equal(got[2][:, rows:], want[2][:, rows:]), "the act scales' padding columns"


def test_fp8_expert_gemm_swiglu_deterministic_graph_and_registration():
    args, _, end = make_case([40, 0, 300, 7] * 4, 512, 512, True, False, seed=11)
    first = [t.clone() for t in ops.fp8_expert_gemm_swiglu(*args, *LAUNCH)]
    again = ops.fp8_expert_gemm_swiglu(*args, *LAUNCH)
    assert torch.equal(again[0][:end], first[0][:end])
    assert torch.equal(again[1][:end].view(torch.uint8), first[1][:end].view(torch.uint8))
    assert torch.equal(again[2][:, :end], first[2][:, :end])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.fp8_expert_gemm_swiglu(*args, *LAUNCH)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0][:end], first[0][:end])
    assert torch.equal(captured[1][:end].view(torch.uint8), first[1][:end].view(torch.uint8))
    op = torch.ops.megatron_mok.fp8_expert_gemm_swiglu.default
    assert_registered_without_mutation(op, (*args, *LAUNCH))


@pytest.mark.parametrize("variant", FP8_GEMM_VARIANTS)
def test_fp8_expert_gemm_promotes_per_k_block(variant):
    """Scales that differ by 2^20 between K blocks: a partial sum spanning two blocks, or a block's
    scale applied to its neighbour, is off by orders of magnitude; per-block promotion is exact up to
    the bf16 rounding (every product and partial here is a small integer, exact in the tensor cores).
    Each mainloop variant on its own, so a variant that swaps two blocks' partials or scales fails
    here by name."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows, k, n = 256, 512, 256
    qa = torch.randint(-3, 4, (rows, k), device="cuda", generator=gen).float().to(E4M3)
    qw = torch.randint(-3, 4, (2, n, k), device="cuda", generator=gen).float().to(E4M3)
    sa = torch.ones(k // 128, rows, device="cuda")
    sa[1::2] = 2.0**-10
    sw = torch.ones(2, n // 128, k // 128, device="cuda")
    sw[:, :, 0] = 2.0**10
    sw[:, 1, :] *= 2.0**-5  # the second 128-column block of every expert
    offsets = torch.tensor([0, 128, rows], dtype=torch.int32, device="cuda")
    out = ops.fp8_expert_gemm(qa, sa, qw, sw, offsets, *LAUNCH, variant=variant).float()
    ref = ops.fp8_expert_gemm_reference(qa, sa, qw, sw, offsets)
    assert torch.equal(out, ref.bfloat16().float())


def test_fp8_expert_gemm_is_bitwise_deterministic():
    args, _, end = case_args("deepseek_v3_fc2")
    first = ops.fp8_expert_gemm(*args, *LAUNCH)[:end]
    for _ in range(2):
        assert torch.equal(ops.fp8_expert_gemm(*args, *LAUNCH)[:end], first)


@pytest.mark.parametrize("group_m", [1, 2, 16])
def test_launch_shape_does_not_change_the_result(group_m):
    """The raster and the cluster size change which CTA computes a tile, never its arithmetic."""
    args, _, end = case_args("qwen3_30b_fc1")
    want = ops.fp8_expert_gemm(*args, 1, 1)[:end]
    for cluster_m in (1, 2):
        if group_m % cluster_m == 0:
            assert torch.equal(ops.fp8_expert_gemm(*args, cluster_m, group_m)[:end], want)


def test_cuda_graph_replay_equals_eager():
    args, _, end = case_args("qwen3_30b_fc2")
    eager = ops.fp8_expert_gemm(*args, *LAUNCH)[:end].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        ops.fp8_expert_gemm(*args, *LAUNCH)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_expert_gemm(*args, *LAUNCH)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:end], eager)


def test_no_rows_anywhere():
    args, _, _ = make_case([0, 0, 0], 128, 256, True, False, seed=4, tail_rows=3)
    out = ops.fp8_expert_gemm(*args, *LAUNCH)  # no tile: nothing to compute, no hang
    torch.cuda.synchronize()
    assert out.shape == (3, 256)
    qa, sa, qw, sw, offsets = args
    empty = ops.fp8_expert_gemm(qa[:0], sa[:, :0], qw, sw, offsets, *LAUNCH)
    assert empty.shape == (0, 256)
    assert ops.last_failure() is None


@pytest.mark.parametrize("case,span", [("deepseek_v3_dgrad_fc1", 1), ("deepseek_v3_dgrad_fc1", 3),
                                       ("qwen3_30b_dgrad_fc1", 8), ("odd_segments_unpadded", 2),
                                       ("many_small_experts", 7)])
def test_expert_ranges_into_one_output_equal_one_launch(case, span):
    """The dgrads' form (backends/kernel_fp8.py _dgrad): launches over consecutive expert ranges, each
    with its slice of the offsets and its experts' weights, writing into one `out`, give one launch's
    output bit for bit, and write no row outside their segments (the rows past the schedule keep the
    sentinel); a range of empty experts writes nothing."""
    args, _, end = case_args(case)
    qa, sa, qw, sw, offsets = args
    want = ops.fp8_expert_gemm(*args, *LAUNCH)
    out = torch.full((qa.shape[0], qw.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    experts = qw.shape[0]
    for first in range(0, experts, span):
        last = min(experts, first + span)
        got = ops.fp8_expert_gemm(qa, sa, qw[first:last].contiguous(), sw[first:last].contiguous(),
                                  offsets[first:last + 1], *LAUNCH, out=out)
        assert got is out
        # nothing at or past the range's last segment written yet (a host read: the test's bookkeeping)
        assert torch.isnan(out[int(offsets[last]):].float()).all(), f"range [{first}, {last}) wrote past its rows"
    assert torch.equal(out[:end], want[:end])
    assert torch.isnan(out[end:].float()).all(), "a row past the last segment was written"
    assert ops.last_failure() is None


def test_out_off_the_inputs_device_is_a_value_error():
    args, _, _ = case_args("one_tile")
    out = torch.zeros(args[0].shape[0], args[2].shape[1], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_expert_gemm: out must be a CUDA tensor on a's device"):
        ops.fp8_expert_gemm(*args, *LAUNCH, out=out)


def test_fp8_expert_gemm_into_registration():
    args, _, end = case_args("odd_segments_unpadded")
    out = torch.zeros(args[0].shape[0], args[2].shape[1], dtype=torch.bfloat16, device="cuda")
    op = torch.ops.megatron_mok.fp8_expert_gemm_into.default
    # (test_faketensor only: the schema check's mutation test compares tensors with an op float8 lacks)
    torch.library.opcheck(op, (*args, *LAUNCH, 0, out), test_utils=("test_faketensor",))
    before = [a.clone() for a in args]
    out.zero_()
    op(*args, *LAUNCH, 0, out)
    assert torch.equal(out[:end], ops.fp8_expert_gemm(*args, *LAUNCH)[:end])
    assert not out[end:].view(torch.int16).any(), "a row past the last segment was written"
    for was, now in zip(before, args):
        assert torch.equal(was.view(torch.uint8) if was.dtype == E4M3 else was,
                           now.view(torch.uint8) if now.dtype == E4M3 else now), "an input was written"


def test_fp8_expert_gemm_op_registration():
    args, _, end = case_args("odd_segments_unpadded")
    op = torch.ops.megatron_mok.fp8_expert_gemm.default
    assert_registered_without_mutation(op, (*args, *LAUNCH))
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)
    assert torch.equal(compiled(*args, *LAUNCH)[:end], ops.fp8_expert_gemm(*args, *LAUNCH)[:end])


# The kernel's own checks, for callers of torch.ops directly (the wrapper raises ValueError first:
# tests/ops/test_fp8_gemm_args.py).
BAD = [
    ("a bf16", lambda a, sa, w, sw, o: (a.bfloat16(), sa, w, sw, o), "float8_e4m3fn"),
    ("K not a multiple of 128", lambda a, sa, w, sw, o: (a[:, :64].contiguous(), sa[:1], w[:, :, :64].contiguous(),
                                                         sw[:, :, :1].contiguous(), o), "multiples of 128"),
    ("a_scales unpadded", lambda a, sa, w, sw, o: (a, sa[:, : a.shape[0]].contiguous(), w, sw, o), "a_scales must be"),
    ("offsets int64", lambda a, sa, w, sw, o: (a, sa, w, sw, o.long()), "expert_offsets must be int32"),
]


@pytest.mark.parametrize("case,change,fragment", BAD, ids=[b[0] for b in BAD])
def test_kernel_checks_are_clear_errors(case, change, fragment):
    args, _, _ = make_case([10, 21], 128, 128, False, False, seed=5)
    with pytest.raises(RuntimeError, match=fragment):
        torch.ops.megatron_mok.fp8_expert_gemm(*change(*args), *LAUNCH)


# The push epilogue: (case, expert span of the launches: None for one launch over all experts).
PUSH_CASES = [("deepseek_v3_fc2", None), ("deepseek_v3_dgrad_fc1", 3), ("odd_segments_unpadded", None),
              ("odd_segments_unpadded", 2), ("many_small_experts", 7), ("qwen3_30b_dgrad_fc1", None)]


def push_problem(num_rows: int, end: int, num_ranks: int, seed: int, topk: int = 2):
    """(slot_to_route (num_rows,) int64, num_tokens): the first `end` rows sent to distinct routes of a
    group of num_ranks ranks (a tenth of them -1, as padding slots are), the rows past `end` -1 (no
    schedule routes a slot past its end); more routes than rows, so some slots stay unwritten."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = -(-num_rows // (num_ranks * topk)) + 5
    routes = torch.randperm(num_ranks * num_tokens * topk, generator=gen)[:num_rows]
    routes[torch.rand(num_rows, generator=gen) < 0.1] = -1
    routes[end:] = -1
    return routes.cuda(), num_tokens


def regions_with_sentinel(num_ranks: int, num_tokens: int, topk: int, n: int) -> list[torch.Tensor]:
    return [torch.full((num_tokens * topk, n), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(num_ranks)]


def launch_push(args, routes, num_tokens, regions, own, span, variant, topk: int = 2, cluster_m: int = LAUNCH[0]):
    qa, sa, qw, sw, offsets = args
    experts = qw.shape[0]
    span = span or experts
    for first in range(0, experts, span):
        last = min(experts, first + span)
        ops.fp8_expert_gemm_push(
            qa, sa, qw[first:last].contiguous(), sw[first:last].contiguous(), offsets[first:last + 1],
            cluster_m, max(LAUNCH[1], cluster_m),
            slot_to_route=routes, topk=topk, num_tokens=num_tokens, own_combine=regions[own],
            peer_combine_ptrs=[r.data_ptr() for r in regions], variant=variant,
        )


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("variant", FP8_PUSH_GEMM_VARIANTS)
@pytest.mark.parametrize("num_ranks", [1, 3])
@pytest.mark.parametrize("case,span", PUSH_CASES)
def test_push_epilogue_writes_what_push_rows_moves(case, span, num_ranks, variant, cluster_m):
    """fp8_expert_gemm_push (over expert ranges where span is given, as the dgrads launch; 2-CTA
    clusters too) leaves every rank's region bit for bit as fp8_expert_gemm then push_rows leave it;
    own region: the last rank's."""
    args, _, end = case_args(case)
    qa, _, qw, _, _ = args
    topk, n = 2, qw.shape[1]
    routes, num_tokens = push_problem(qa.shape[0], end, num_ranks, seed=zlib.crc32(f"{case}/{num_ranks}".encode()))
    want = regions_with_sentinel(num_ranks, num_tokens, topk, n)
    ops.push_rows(ops.fp8_expert_gemm(*args, *LAUNCH), routes, topk, num_tokens, want[-1], [r.data_ptr() for r in want])
    got = regions_with_sentinel(num_ranks, num_tokens, topk, n)
    launch_push(args, routes, num_tokens, got, num_ranks - 1, span, variant, cluster_m=cluster_m)
    torch.cuda.synchronize()
    assert ops.last_failure() is None
    for rank, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"rank {rank}'s region differs"
    written = sum(int((~torch.isnan(w.float())).all(dim=1).sum()) for w in want)
    assert written == int(((routes >= 0) & (torch.arange(len(routes), device="cuda") < end)).sum()) > 0


@pytest.mark.parametrize("variant", FP8_PUSH_GEMM_VARIANTS)
def test_push_epilogue_is_deterministic_and_replays_in_a_graph(variant):
    args, _, end = case_args("qwen3_30b_fc2")
    routes, num_tokens = push_problem(args[0].shape[0], end, 2, seed=9)
    eager = regions_with_sentinel(2, num_tokens, 2, args[2].shape[1])
    launch_push(args, routes, num_tokens, eager, 0, None, variant)
    regions = regions_with_sentinel(2, num_tokens, 2, args[2].shape[1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        launch_push(args, routes, num_tokens, regions, 0, None, variant)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_push(args, routes, num_tokens, regions, 0, None, variant)
    for _ in range(2):
        for r in regions:
            r.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for g, w in zip(regions, eager):
            assert torch.equal(g.view(torch.int16), w.view(torch.int16))


def test_fp8_expert_gemm_push_registration():
    args, _, end = case_args("odd_segments_unpadded")
    routes, num_tokens = push_problem(args[0].shape[0], end, 1, seed=3)
    own = torch.zeros(num_tokens * 2, args[2].shape[1], dtype=torch.bfloat16, device="cuda")
    op = torch.ops.megatron_mok.fp8_expert_gemm_push.default
    # (test_faketensor only, as fp8_expert_gemm_into's)
    torch.library.opcheck(op, (*args, *LAUNCH, 2, routes, 2, num_tokens, own, [own.data_ptr()]),
                          test_utils=("test_faketensor",))


# ---- the SwiGLU-backward epilogue (ops.fp8_expert_gemm_swiglu_backward) ------------------------
# Its oracle is the two launches it replaces, fp8_expert_gemm then fp8_quantize_swiglu_backward (each
# held to its reference by its own tests): the same rounding of d act, the same fp32 SwiGLU backward,
# the same amax and quantization, so the bar is bit for bit on every row of the segments.
SWIGLU_BACKWARD_CASES = {
    "deepseek_v3": ([257, 0, 1023], 7168, 2048, True, True),
    "qwen3_30b": ([40, 0, 300, 7] * 8, 2048, 768, True, True),
    "odd_segments_unpadded": CASES["odd_segments_unpadded"],
    "many_small_experts": CASES["many_small_experts"],
}


def swiglu_backward_case(name):
    """(the GEMM's args, gate_up (R, 2F) bf16, the schedule's end); gate_up from a normal draw with
    large values among them (the SwiGLU backward's sigmoid saturates, d up grows with |gate|)."""
    rows, k, n, padded, transposed = SWIGLU_BACKWARD_CASES[name]
    args, _, end = make_case(rows, k, n, padded, transposed, seed=zlib.crc32(name.encode()) % 1000)
    gen = torch.Generator(device="cuda").manual_seed(11)
    gate_up = (torch.randn(args[0].shape[0], 2 * n, device="cuda", generator=gen) * 3).bfloat16()
    return args, gate_up, end


def two_launches(args, gate_up, cluster_m, pow2):
    grad_act = ops.fp8_expert_gemm(*args, cluster_m, FP8_EXPERT_GEMM_GROUP_M)
    return ops.fp8_quantize_swiglu_backward(gate_up, grad_act, args[4], pow2=pow2)


def assert_swiglu_backward_equal(got, want, end):
    grad_gate_up, q, scales = got
    assert torch.equal(grad_gate_up[:end], want[0][:end])
    assert torch.equal(q[:end].view(torch.uint8), want[1][:end].view(torch.uint8))
    assert torch.equal(scales[:, :end], want[2][:, :end])


@pytest.mark.parametrize("variant", FP8_SWIGLU_BACKWARD_GEMM_VARIANTS)
@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("case", list(SWIGLU_BACKWARD_CASES))
def test_swiglu_backward_epilogue_equals_the_two_launches(case, cluster_m, variant):
    args, gate_up, end = swiglu_backward_case(case)
    want = two_launches(args, gate_up, cluster_m, pow2=False)
    poison_allocator()
    got = ops.fp8_expert_gemm_swiglu_backward(*args, cluster_m, FP8_EXPERT_GEMM_GROUP_M, gate_up=gate_up,
                                              variant=variant)
    assert_swiglu_backward_equal(got, want, end)
    rows = args[0].shape[0]
    assert torch.equal(got[2][:, rows:], torch.ones_like(got[2][:, rows:])), "the scales' padding columns hold 1"
    assert ops.last_failure() is None


def test_swiglu_backward_epilogue_power_of_two_scales():
    args, gate_up, end = swiglu_backward_case("qwen3_30b")
    want = two_launches(args, gate_up, LAUNCH[0], pow2=True)
    got = ops.fp8_expert_gemm_swiglu_backward(*args, *LAUNCH, gate_up=gate_up, pow2=True, variant="overlap")
    assert_swiglu_backward_equal(got, want, end)
    scales = got[2][:, :end]
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round())), "a scale not a power of two"


@pytest.mark.parametrize("span", [1, 3])
def test_swiglu_backward_expert_ranges_into_one_output_equal_one_launch(span):
    """dgrad's expert ranges (backends/kernel_fp8.py): launches over consecutive ranges into one output
    give one launch's bits, and write no row past their segments."""
    args, gate_up, end = swiglu_backward_case("qwen3_30b")
    qa, sa, qw, sw, offsets = args
    want = ops.fp8_expert_gemm_swiglu_backward(*args, *LAUNCH, gate_up=gate_up, variant="overlap")
    rows, two_ffn = gate_up.shape
    out = (torch.full_like(gate_up, float("nan")), torch.full_like(want[1].view(torch.uint8), 0x7F).view(E4M3),
           torch.full_like(want[2], float("nan")))
    experts = qw.shape[0]
    for first in range(0, experts, span):
        last = min(experts, first + span)
        got = ops.fp8_expert_gemm_swiglu_backward(qa, sa, qw[first:last].contiguous(), sw[first:last].contiguous(),
                                                  offsets[first:last + 1], *LAUNCH, gate_up=gate_up,
                                                  variant="overlap", out=out)
        assert all(g is o for g, o in zip(got, out))
        assert torch.isnan(out[0][int(offsets[last]):].float()).all(), f"range [{first}, {last}) wrote past its rows"
    assert_swiglu_backward_equal(out, want, end)
    assert torch.isnan(out[0][end:].float()).all()


def test_swiglu_backward_epilogue_is_deterministic_and_replays_in_a_graph():
    args, gate_up, end = swiglu_backward_case("qwen3_30b")
    run = lambda: ops.fp8_expert_gemm_swiglu_backward(*args, *LAUNCH, gate_up=gate_up, variant="overlap")  # noqa: E731
    eager = [t.clone() for t in run()]
    assert_swiglu_backward_equal(run(), eager, end)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(2):
        out[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_swiglu_backward_equal(out, eager, end)


def test_fp8_expert_gemm_swiglu_backward_registration():
    args, gate_up, _ = swiglu_backward_case("odd_segments_unpadded")
    out = ops.fp8_expert_gemm_swiglu_backward(*args, *LAUNCH, gate_up=gate_up)
    op = torch.ops.megatron_mok.fp8_expert_gemm_swiglu_backward_into.default
    # (test_faketensor only, as fp8_expert_gemm_into's: the schema check compares float8 tensors with
    # an op float8 lacks; the inputs are checked unwritten by hand)
    torch.library.opcheck(op, (*args, *LAUNCH, 0, gate_up, *out, False), test_utils=("test_faketensor",))
    before = [t.clone() for t in (*args, gate_up)]
    op(*args, *LAUNCH, 0, gate_up, *out, False)
    for was, now in zip(before, (*args, gate_up)):
        assert torch.equal(was.view(torch.uint8) if was.dtype == E4M3 else was,
                           now.view(torch.uint8) if now.dtype == E4M3 else now), "an input was written"
