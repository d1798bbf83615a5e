"""The kernel backend's tuning table: which kernel runs each expert projection, and its launch shape.

Every entry is a choice measured on the H200 (scripts/bench_expert_gemm.py, docs/performance.md);
none changes a result: every family gives the same bound against fp32 and is bitwise reproducible
run to run. Limits that the kernels and Python must agree on live in megatron_mok/limits.py.
"""

from __future__ import annotations

import dataclasses

# The expert projections of a pass, as `MoKConfig.expert_gemm` families choose them.
PROJECTIONS = ("gate_up", "down", "dgrad_down", "dgrad_gate_up", "weight_grads")
FAMILIES = ("grouped_mm", "sm90")


@dataclasses.dataclass(frozen=True)
class ExpertGemmChoice:
    """The GEMM family per projection: "sm90" (csrc/gemm/) or "grouped_mm" (torch's CUTLASS)."""

    gate_up: str  # the pull dispatch + gate/up + SwiGLU (sm90: dispatch inside the GEMM)
    down: str
    dgrad_down: str  # the down projection's dgrad with the SwiGLU backward
    dgrad_gate_up: str  # d rows from d gate_up
    weight_grads: str  # d fc1 and d fc2

    def __post_init__(self) -> None:
        for name in PROJECTIONS:
            if getattr(self, name) not in FAMILIES:
                raise ValueError(f"ExpertGemmChoice.{name} must be one of {FAMILIES}, got {getattr(self, name)!r}")


EXPERT_GEMM_CHOICES = {
    # Per projection the faster on the H200, same inputs, one run: ours for down, the gate/up dgrad and
    # the weight gradients; torch's CUTLASS for gate/up and the down dgrad with the SwiGLU backward.
    "auto": ExpertGemmChoice(
        gate_up="grouped_mm", down="sm90", dgrad_down="grouped_mm", dgrad_gate_up="sm90", weight_grads="sm90"
    ),
    "grouped_mm": ExpertGemmChoice(*(["grouped_mm"] * len(PROJECTIONS))),
    "sm90": ExpertGemmChoice(*(["sm90"] * len(PROJECTIONS))),
}

# CTAs per cluster of the sm90 expert GEMMs. 2: pairs of CTAs share each weight slice through TMA
# multicast; 1: none. The dispatching gate/up GEMM runs pairs, the others single CTAs.
DISPATCH_GEMM_CLUSTER_M = 2
EXPERT_GEMM_CLUSTER_M = 1

# The tile raster of the sm90 expert GEMMs: within an expert, groups of this many m-tiles are walked
# m fastest, so the CTAs working at once share weight slices and rows in L2.
EXPERT_GEMM_GROUP_M = 16

# The FP8 blockwise grouped GEMMs (ops.fp8_expert_gemm, ops.fp8_expert_gemm_swiglu). The default
# kernel's tile is fixed at compile time (csrc/gemm/fp8_gemm_sm90.cuh Fp8GemmTile): 128 rows x 128 B
# rows (two halves of 64, each inside one 128 x 128 weight scale block), one 128-wide K block per stage
# (the promotion unit), 6 stages (5 when the BF16 kernels are built with MOK_EXPERT_GEMM_STAGES=3, which
# doubles the staging buffers); the SwiGLU variant runs two passes per 128 act columns. The launch:
# single-CTA clusters (2-CTA clusters sharing each weight slice through TMA multicast were no faster in
# any mainloop: wide_ordered at 2-CTA clusters ran 1-3% below single CTAs at the card's power cap,
# docs/performance.md "The wide FP8 GEMM with its consumers' blocks issued in turn") and raster
# groups of 16 m-tiles.
FP8_EXPERT_GEMM_CLUSTER_M = 1
FP8_EXPERT_GEMM_GROUP_M = 16
# The mainloop of the FP8 GEMMs that store their bf16 rows (fc2 and the dgrads at EP = 1 or over the
# collective exchange, fc1 before the act kernel): "wide_ordered_staged_scales"
# (ops.fp8_gemm.FP8_GEMM_VARIANTS; the kernel of csrc/gemm/fp8_gemm_wide_sm90.cuh: 128 x 192 tiles,
# one m64n192k32 wgmma per 32 of K and one partial sum per warpgroup, its stage descriptors in uniform
# registers, the two consumer warpgroups issuing their K blocks in turn through a named barrier, and
# the A scales bulk-copied into each stage beside its operands, as cuBLASLt's blockwise kernel does
# both). Beside "wide_ordered" (the same turns, the A scales loaded from global memory a block ahead)
# it ran 1.05-1.10x in single calls and level to 1.04x at the card's power cap, and took the
# DeepSeek-V3 layer's forward + backward from 26.94 to 26.34 ms, over the in-kernel exchange from
# 29.07 to 28.26 (H100; docs/performance.md, "The wide FP8 GEMM in turn with its A scales through the
# stages"). "wide_ordered" itself ran 1.05-1.15x "wide" (the warpgroups issuing whenever ready) at
# the power cap. "wide_across_tiles" (the next tile's first K block issued before a tile's epilogue,
# without the turns) was within the spread of "wide" in the layer; "wide_ordered_across_tiles" (both)
# 0-3% above wide_ordered in single calls, level at the power cap and 0.7 ms slower in the DeepSeek-V3
# layer. Every mainloop gives the default's bits (tests/ops/test_gpu_fp8_gemm.py), so the choice is
# speed only.
FP8_EXPERT_GEMM_VARIANT = "wide_ordered_staged_scales"
# Over the in-kernel exchange, the FP8 down projection and gate/up dgrad push their rows from the
# GEMM's epilogue (ops.fp8_expert_gemm_push) instead of writing (capacity, H) bf16 rows that the
# push kernel then reads and copies: the same bytes in the combine regions, without a write and read
# of the rows in this rank's memory per pass (docs/performance.md, "The push in the FP8 GEMM's
# epilogue"). The push GEMM is built in the default and overlap mainloops and the wide kernel
# (ops.fp8_gemm.FP8_PUSH_GEMM_VARIANTS; ops.fp8_expert_gemm_push refuses the others by name); it runs
# FP8_PUSH_GEMM_VARIANT, the storing GEMMs' mainloop: the one-rank step over the in-kernel exchange
# took 28.26 ms with both in wide_ordered_staged_scales against 29.07 with both in wide_ordered
# (DeepSeek-V3, one window; Qwen3-30B 11.22 against 11.38; H100, scripts/bench_windows.py
# --gemm-variants wide_ordered,wide_ordered_staged_scales), as wide_ordered had against wide.
FP8_PUSH_IN_EPILOGUE = True
FP8_PUSH_GEMM_VARIANT = "wide_ordered_staged_scales"
# The SwiGLU-epilogue GEMM of the forward gate/up (ops.fp8_expert_gemm_swiglu) runs the overlap
# mainloop, its fastest (751 vs 658 TFLOP/s at DeepSeek-V3, 571 vs 507 at Qwen3-30B on the H200,
# docs/performance.md).
FP8_EXPERT_GEMM_SWIGLU_VARIANT = "overlap"
# With FP8 weight gradients and this on, the down projection's dgrad runs the SwiGLU backward and d
# gate_up's row-wise quantization in its epilogue (ops.fp8_expert_gemm_swiglu_backward) instead of
# writing d act (capacity, F) bf16 for ops.fp8_quantize_swiglu_backward to read back in a launch of
# its own: the same bytes of d gate_up and its FP8 copy on the segments' rows
# (tests/ops/test_gpu_fp8_gemm.py). Off: the epilogue's fp32 SwiGLU backward and quantization run on
# the GEMM's eight consumer warps per SM with the tensor cores idle, ~50 us a tile, where the
# standalone kernel hides the same arithmetic behind a full SM of warps: the op took 5.17 ms against
# 2.67 for the two launches at DeepSeek-V3 EP 8, 3.01 against 1.01 at Qwen3-30B (H100,
# docs/performance.md, 2026-12-06).
FP8_SWIGLU_BACKWARD_IN_DGRAD = False
FP8_SWIGLU_BACKWARD_GEMM_VARIANT = "overlap"
# With FP8 weight gradients (and the SwiGLU backward outside the dgrad), d gate_up's two FP8 copies
# from one launch over 128 x 128 tiles (ops.fp8_quantize_swiglu_backward_copies: no bf16 d gate_up
# written and read back, 10 bytes per row and F column moved against the two launches' 18) instead
# of ops.fp8_quantize_swiglu_backward then ops.fp8_quantize_columns: the same bytes of both copies
# (tests/ops/test_gpu_fp8_quant.py). Off until measured against the two launches on a GPU: its first
# form (2026-12-04, before the SwiGLU math's batched fast path) was slower, issue-bound.
FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS = False
# With the one pass above (and backward needing act for the fc2 weight gradient), act's column copy
# from the same pass too (ops.fp8_quantize_swiglu_backward_copies with act_columns: gate_up read once
# where ops.fp8_quantize_swiglu_columns reads it a second time), the same bytes. Its third 32 KB tile
# leaves two CTAs per SM where the pass without it runs three, and act's copy is allocated beside d
# act (capacity, F) bf16 instead of after it is freed: within memory_fp8.layer_memory_bound still,
# whose SwiGLU backward stage counts the bf16 d gate_up (4 bytes per row and F column) where the one
# pass holds the two column copies (about 3.1 with their scales). Off until measured on a GPU.
FP8_ACT_COLUMNS_IN_ONE_PASS = False

# Where the forward's act is quantized (the same bytes either way in the rows before the schedule's
# end, the only ones read: tests/ops/test_gpu_fp8_quant.py, tests/ops/test_gpu_fp8_gemm.py):
# "gemm_epilogue", by the gate/up GEMM's SwiGLU epilogue (ops.fp8_expert_gemm_swiglu: two passes
# over K per 128 act columns, the epilogue not overlapped with any MMA); "swiglu_kernel", by
# ops.fp8_quantize_swiglu after the plain FP8 gate/up GEMM (one more read of gate_up, memory-bound).
# Chosen by the layer's time on the H200 (docs/performance.md, "The FP8 blockwise layer"). pow2
# scales always take the kernel (the epilogue writes IEEE scales only).
FP8_ACT_QUANTIZE_CHOICES = ("gemm_epilogue", "swiglu_kernel")
FP8_ACT_QUANTIZE = "swiglu_kernel"

# How many expert ranges a one-window FP8 backward multiplies each dgrad in (backends/kernel_fp8.py
# _dgrad): each range's transposed weight copy is made, used by one GEMM launch over the range's
# segments and freed, so a backward holds at most ceil(E / this) experts' transposed copy at a time
# (fc1's whole copy is 0.9 GB at DeepSeek-V3 size, in the gate/up dgrad's stage). The launches give
# one launch's bits; what they cost (a launch's tail per range: nothing measurable at 4) is in
# docs/performance.md ("The FP8 layer's memory stage by stage, and its dgrads by expert range").
# 1 makes the whole copy at once.
FP8_DGRAD_EXPERT_RANGES = 4


def fp8_dgrad_expert_span(num_experts: int) -> int:
    """The experts of one FP8_DGRAD_EXPERT_RANGES range: ceil(num_experts / ranges). A setting that is
    not a positive int is a ValueError naming it (a dgrad must never skip experts)."""
    ranges = FP8_DGRAD_EXPERT_RANGES
    if isinstance(ranges, bool) or not isinstance(ranges, int) or ranges < 1:
        raise ValueError(f"backends.tuning.FP8_DGRAD_EXPERT_RANGES must be a positive int, got {ranges!r}")
    return -(-num_experts // ranges)


# The FP8 weight gradient's kernel (ops.fp8_wgrad.FP8_WGRAD_VARIANTS): "overlap" issues block k + 1's
# wgmmas before block k is promoted (two partial sums per warpgroup, 128 x 128 tiles);
# "overlap_across_tiles" also issues the next tile's first block before a tile's epilogue (its tiles are
# short: 8 to 16 blocks at the Qwen3-30B and DeepSeek-V3 shapes); "wide" is a kernel of its own in
# 128 x 192 tiles (one partial per warpgroup, the next tile's first block before the epilogue, a sixth
# fewer operand bytes per FLOP), as the storing GEMMs' FP8_EXPERT_GEMM_VARIANT. All give the same bits.
# wide ran 1.15-1.17x overlap_across_tiles at the DeepSeek-V3 and Qwen3-30B shapes (800-840 TFLOP/s on
# the H100) and took 0.55-1.17 ms off the DeepSeek-V3 layer's step (docs/performance.md, "The FP8
# weight gradient in 128 x 192 tiles"). "wide_ordered" (its consumers' blocks issued in turn, as the
# storing GEMMs' wide_ordered) was 0.2-1.7% slower than wide in single calls and 0.4 ms slower in the
# DeepSeek-V3 layer, so the weight gradient keeps "wide".
FP8_WGRAD_VARIANT = "wide"

# Over the in-kernel exchange (symmetric regions), where the FP8 weight gradients' bf16 operands come
# from: True, quantized column-wise straight from the ranks' regions (ops.fp8_quantize_columns_from_peers:
# fc1's x rows, fc2's w * dY), as from one tensor at EP = 1 without the exchange; False, pulled into
# (capacity, H) bf16 rows first (the dispatch's and the weighted pull's kernels), then quantized. The
# same bits either way (tests/ops/test_gpu_fp8_quant.py, tests/backends/test_gpu_fp8_kernel.py -k
# regions). True saves the pulls' 2 * s * W * H bytes (memory_fp8.layer_memory_bound counts them only
# when False) and their time (docs/performance.md, "The FP8 weight gradients' operands from the
# regions").
FP8_WGRAD_COLUMNS_FROM_PEERS = True
