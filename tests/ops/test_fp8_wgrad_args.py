"""ops.fp8_expert_wgrad on the CPU: its argument checks (types, dtypes, shapes, multiples of 128, flags and
contiguity before devices, so every error but the device's shows without a GPU and before any kernel
runs), its reference against the formula, and ptxas's verdict on the kernel (the kernel's results:
tests/ops/test_gpu_fp8_wgrad.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import ops
from megatron_mok.ops import fp8_wgrad
from cuda_checks import NEEDS_TOOLCHAIN

E4M3 = torch.float8_e4m3fn
M, N, R, E = 256, 384, 512, 3


def wgrad_args(**changes):
    """Valid arguments (but for the device: CPU tensors), with `changes` applied."""
    args = dict(
        grad=torch.zeros(M, R, dtype=E4M3),
        grad_scales=torch.ones(R // 128, M),
        inputs=torch.zeros(N, R, dtype=E4M3),
        inputs_scales=torch.ones(R // 128, N),
        expert_offsets=torch.tensor([0, 128, 128, 512], dtype=torch.int32),
        out=torch.zeros(E, M, N),
        accumulate=False,
        window_begin=0,
    )
    args.update(changes)
    return args


SHARED_CARRY = torch.zeros(M, N)  # one buffer given as both carries

# name: (the changed arguments, the error's words)
BAD_ARGS = {
    "grad_bf16": (dict(grad=torch.zeros(M, R, dtype=torch.bfloat16)), "grad must be torch.float8_e4m3fn"),
    "inputs_e5m2": (dict(inputs=torch.zeros(N, R, dtype=torch.float8_e5m2)), "inputs must be torch.float8_e4m3fn"),
    "grad_scales_bf16": (dict(grad_scales=torch.ones(R // 128, M, dtype=torch.bfloat16)),
                         "grad_scales must be torch.float32"),
    "inputs_scales_fp64": (dict(inputs_scales=torch.ones(R // 128, N, dtype=torch.float64)),
                           "inputs_scales must be torch.float32"),
    "offsets_int64": (dict(expert_offsets=torch.tensor([0, 128, 128, 512])), "expert_offsets must be torch.int32"),
    "out_bf16": (dict(out=torch.zeros(E, M, N, dtype=torch.bfloat16)), "out must be torch.float32"),
    "grad_not_tensor": (dict(grad=[[0.0] * R] * M), "grad must be a tensor"),
    "grad_3d": (dict(grad=torch.zeros(1, M, R, dtype=E4M3)), r"grad must be \(m, R\)"),
    "inputs_1d": (dict(inputs=torch.zeros(N * R, dtype=E4M3)), r"inputs must be \(n, R\)"),
    # Row-wise (R, n) instead of column-wise (n, R): R no longer matches.
    "inputs_row_wise": (dict(inputs=torch.zeros(R, N, dtype=E4M3)), r"inputs \(n, R\) must have grad's R = 512"),
    "rows_not_multiple_of_128": (
        dict(grad=torch.zeros(M, 200, dtype=E4M3), inputs=torch.zeros(N, 200, dtype=E4M3)),
        "R .* must be a multiple of 128, got 200",
    ),
    "m_not_multiple_of_128": (dict(grad=torch.zeros(192, R, dtype=E4M3)), "m .* must be a positive multiple of 128"),
    "n_not_multiple_of_128": (dict(inputs=torch.zeros(320, R, dtype=E4M3)), "n .* must be a positive multiple of 128"),
    "grad_scales_row_layout": (dict(grad_scales=torch.ones(M, R // 128)), r"grad_scales must be \(R/128, m\)"),
    "inputs_scales_short": (dict(inputs_scales=torch.ones(R // 128 - 1, N)), r"inputs_scales must be \(R/128, n\)"),
    "offsets_2d": (dict(expert_offsets=torch.zeros(1, 4, dtype=torch.int32)), r"expert_offsets must be \(E \+ 1,\)"),
    "offsets_no_expert": (dict(expert_offsets=torch.zeros(1, dtype=torch.int32)),
                          r"expert_offsets must be \(E \+ 1,\)"),
    "out_wrong_experts": (dict(out=torch.zeros(E + 1, M, N)), r"out must be \(E, m, n\) = \(3, 256, 384\)"),
    "out_transposed": (dict(out=torch.zeros(E, N, M)), r"out must be \(E, m, n\)"),
    "accumulate_int": (dict(accumulate=1), "accumulate must be a bool"),
    "accumulate_without_out": (dict(out=None, accumulate=True), "accumulate=True adds to out: out must be given"),
    "window_begin_float": (dict(window_begin=128.0), "window_begin must be an int"),
    "window_begin_bool": (dict(window_begin=True), "window_begin must be an int"),
    "window_begin_negative": (dict(window_begin=-128), "window_begin must be a non-negative multiple of 128"),
    "window_begin_inside_a_block": (dict(window_begin=64), "window_begin must be a non-negative multiple of 128"),
    "window_past_2_31": (dict(window_begin=(1 << 31) - 128), "window_begin \\+ R and E \\* m must be below 2\\^31"),
    "grad_not_contiguous": (dict(grad=torch.zeros(R, M, dtype=E4M3).t()), "grad must be contiguous"),
    "out_not_contiguous": (dict(out=torch.zeros(E, N, M).transpose(1, 2)), "out must be contiguous"),
    "grad_scales_misaligned": (dict(grad_scales=torch.ones(R // 128 * M + 1)[1:].view(R // 128, M)),
                               "grad_scales must start 16-byte aligned"),
    "rounded_fp32": (dict(rounded=torch.zeros(E, M, N)), "rounded must be torch.bfloat16"),
    "rounded_wrong_shape": (dict(rounded=torch.zeros(E, N, M, dtype=torch.bfloat16)),
                            r"rounded must be \(E, m, n\) = \(3, 256, 384\)"),
    "variant_unknown": (dict(variant="pingpong"),
                        r"variant must be one of \('default', 'overlap', 'overlap_across_tiles', 'wide', 'wide_ordered'\)"),
    "carry_not_a_pair": (dict(out=None, rounded=torch.zeros(E, M, N, dtype=torch.bfloat16), carry=torch.zeros(M, N)),
                         r"carry must be a pair \(carry_in, carry_out\)"),
    "carry_bf16": (dict(out=None, rounded=torch.zeros(E, M, N, dtype=torch.bfloat16),
                        carry=(torch.zeros(M, N, dtype=torch.bfloat16), torch.zeros(M, N))), "carry_in must be torch.float32"),
    "carry_transposed": (dict(out=None, rounded=torch.zeros(E, M, N, dtype=torch.bfloat16),
                              carry=(torch.zeros(M, N), torch.zeros(N, M))), r"carry_out must be \(m, n\) = \(256, 384\)"),
    "carry_without_rounded": (dict(out=None, carry=(torch.zeros(M, N), torch.zeros(M, N))),
                              r"carry \(the windowed form\) takes rounded, without out and accumulate"),
    "carry_with_out": (dict(rounded=torch.zeros(E, M, N, dtype=torch.bfloat16), carry=(torch.zeros(M, N), torch.zeros(M, N))),
                       r"carry \(the windowed form\) takes rounded, without out and accumulate"),
    "carry_with_accumulate": (dict(out=None, accumulate=True, rounded=torch.zeros(E, M, N, dtype=torch.bfloat16),
                                   carry=(torch.zeros(M, N), torch.zeros(M, N))), "accumulate=True adds to out"),
    "carries_one_buffer": (dict(out=None, rounded=torch.zeros(E, M, N, dtype=torch.bfloat16),
                                carry=(SHARED_CARRY, SHARED_CARRY)), "carry_in and carry_out must not overlap"),
    "cpu_tensors": ({}, r"grad must be a CUDA tensor on grad's device"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_argument_is_a_value_error_naming_it(case):
    changes, words = BAD_ARGS[case]
    args = wgrad_args(**changes)
    out = args.pop("out")
    with pytest.raises(ValueError, match=f"fp8_expert_wgrad: {words}"):
        ops.fp8_expert_wgrad(**args, out=out) if out is not None else ops.fp8_expert_wgrad(**args)


def formula_float64(grad, grad_scales, inputs, inputs_scales, offsets, window_begin):
    """docs/design.md §12.3 written out in float64, block by block, for the window's rows."""
    rows = grad.shape[1]
    want = torch.zeros(offsets.shape[0] - 1, grad.shape[0], inputs.shape[0], dtype=torch.float64)
    for e in range(want.shape[0]):
        lo = min(max(int(offsets[e]) - window_begin, 0), rows)
        hi = min(max(int(offsets[e + 1]) - window_begin, lo), rows)
        for start in range(lo, hi, 128):
            b = start // 128
            cols = slice(start, start + 128)
            partial = grad[:, cols].double() @ inputs[:, cols].double().T
            want[e] += grad_scales[b].double()[:, None] * inputs_scales[b].double()[None, :] * partial
    return want


# (window_begin, the schedule's offsets): over the window's 640 rows, expert 2 is empty and expert 3
# ends at the window's row 600, inside a block (rows 600..639 are padding, zero); with window_begin
# 256, expert 0 lies before the window and expert 1 straddles its start.
WINDOWS = {"whole_schedule": (0, [0, 128, 512, 512, 600]), "later_window": (256, [0, 128, 384, 384, 856])}


@pytest.mark.parametrize("window", list(WINDOWS))
def test_reference_is_the_promoted_block_formula(window):
    """The reference on CPU tensors against the formula in float64. Small integer values and
    power-of-two scales make every product, partial and sum exact in fp32, so the two must be equal."""
    window_begin, offsets = WINDOWS[window]
    gen = torch.Generator().manual_seed(0)
    rows = 640
    grad = torch.randint(-4, 5, (M, rows), generator=gen).float()
    inputs = torch.randint(-4, 5, (N, rows), generator=gen).float()
    grad[:, 600:] = 0
    inputs[:, 600:] = 0
    grad, inputs = grad.to(E4M3), inputs.to(E4M3)
    grad_scales = 2.0 ** torch.randint(-3, 4, (rows // 128, M), generator=gen).float()
    inputs_scales = 2.0 ** torch.randint(-3, 4, (rows // 128, N), generator=gen).float()
    offsets = torch.tensor(offsets, dtype=torch.int32)
    got = ops.fp8_expert_wgrad_reference(grad, grad_scales, inputs, inputs_scales, offsets, window_begin)
    want = formula_float64(grad, grad_scales, inputs, inputs_scales, offsets, window_begin)
    assert got.dtype == torch.float32 and got.shape == (4, M, N)
    assert torch.equal(got.double(), want)
    assert torch.equal(got[2], torch.zeros(M, N))  # the empty expert
    assert (got[3] != 0).any() and (got[1] != 0).any()


def test_reference_clamps_every_expert_to_the_window():
    """Experts entirely before or after the window contribute zeros; the one straddling its start
    contributes its rows inside it only."""
    grad = torch.ones(128, 256).to(E4M3)
    inputs = torch.ones(128, 256).to(E4M3)
    scales = torch.ones(2, 128)
    offsets = torch.tensor([0, 128, 384, 1024], dtype=torch.int32)  # window: rows [256, 512)
    got = ops.fp8_expert_wgrad_reference(grad, scales, inputs, scales, offsets, window_begin=256)
    assert torch.equal(got[0], torch.zeros(128, 128))
    assert torch.equal(got[1], torch.full((128, 128), 128.0))  # rows [256, 384)
    assert torch.equal(got[2], torch.full((128, 128), 128.0))  # rows [384, 512)




@NEEDS_TOOLCHAIN
def test_kernel_compiles_without_spills_or_wgmma_serialization(tmp_path):
    """ptxas's verdict on the kernels (csrc/bindings/fp8_wgrad_ops.cu compiled as setup.py does): no
    spill (default: the promoted sums and the block's partial; overlap and overlap_across_tiles: the
    sums and two partials, 3 x 64 registers, inside the consumers' setmaxnreg budget; wide: the sums
    and one partial, 2 x 96, with and without the consumers' turns), none of the silent losses
    test_extension.py lists for the BF16 kernels (C7510 a call, C7507 setmaxnreg ignored, C7518 /
    C7515 wgmma serialized), nor the waits ptxas injects for accumulators (C7514 / C7517). And in the
    SASS, wide_ordered takes the turns' named barrier (5, both consumer warpgroups' 256 threads) at
    two predicated sites, the other kernels never (csrc/gemm/fp8_wgrad_wide_sm90.cuh kIssueOrder)."""
    from cuda_checks import named_barrier_syncs, ptxas_report, sass_by_function

    log, found = ptxas_report("fp8_wgrad_ops.cu", tmp_path)
    # (C7514 / C7517: ptxas found accumulators read while their wgmmas may be in flight and waited
    # for them, as it did for a first form of overlap_across_tiles that issued a tile's first block
    # under a condition.)
    for warning in ("C7510", "C7507", "C7518", "C7515", "C7514", "C7517"):
        assert warning not in log, log
    kernels = [(name, spill) for name, spill in found
               if "Fp8ExpertWgradKernel" in name or "Fp8ExpertWgradWideKernel" in name]
    assert len(kernels) == len(fp8_wgrad.FP8_WGRAD_VARIANTS), log[-4000:]
    for name, spill in kernels:
        assert spill == 0, f"{spill} bytes spilled in {name}"
    ordered = 0
    for name, code in sass_by_function(str(tmp_path / "fp8_wgrad_ops.cu.o")).items():
        if "Fp8ExpertWgrad" not in name:
            continue
        turns = named_barrier_syncs(code, 5, 256)
        if "Fp8ExpertWgradWideKernelILb1E" in name:
            ordered += 1
            assert len(turns) == 2 and all(turn.startswith("@") for turn in turns), (name, turns)
        else:
            assert not turns, (name, turns)
    assert ordered == 1, ordered


def test_the_column_wise_quantization_is_the_layout_the_kernel_takes():
    """quantization.quantize_columnwise's (C, R) operands pass every check but the device's: tokens
    contiguous in memory, not a transposed view of an (R, C) tensor."""
    from megatron_mok import quantization

    g, x = torch.randn(R, M), torch.randn(R, N)
    qg, sg = quantization.quantize_columnwise(g)
    qx, sx = quantization.quantize_columnwise(x)
    assert qg.is_contiguous() and qx.is_contiguous() and sg.is_contiguous() and sx.is_contiguous()
    args = wgrad_args(grad=qg, grad_scales=sg, inputs=qx, inputs_scales=sx)
    with pytest.raises(ValueError, match="must be a CUDA tensor|device"):
        ops.fp8_expert_wgrad(**args)


def test_rounded_sharing_out_memory_is_a_value_error():
    """With accumulate the kernel reads out while other CTAs write rounded: the two must not overlap."""
    args = wgrad_args(accumulate=True)
    out = args.pop("out")
    rounded = out.view(torch.bfloat16)[..., :N]  # (E, M, N) bf16 over out's first bytes
    with pytest.raises(ValueError, match="fp8_expert_wgrad: out and rounded must not overlap"):
        ops.fp8_expert_wgrad(**args, out=out, rounded=rounded)
    apart = torch.zeros(E, M, N, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):  # every check but the device's passes
        ops.fp8_expert_wgrad(**args, out=out, rounded=apart)
