"""The FP8 blockwise grouped GEMM of the expert segments (csrc/gemm/fp8_gemm_sm90.cuh; docs/design.md
§12): E4M3 rows times E4M3 expert weights with promotion to fp32 every 128 of K, bf16 out.

Notation: R rows of the schedule, K the reduction dimension, N output columns, E experts. Operands
are (data, scales) pairs in the layouts of megatron_mok/quantization.py:
    a              (R, K) float8_e4m3fn, row-major          quantization.quantize_rowwise
    a_scales       (K/128, fp8_scale_rows(R)) float32       quantization.gemm_a_scales
    weight         (E, N, K) float8_e4m3fn                  quantization.quantize_weight (fprop), or
    weight_scales  (E, N/128, K/128) float32                quantization.transpose_weight of it (dgrad)
    expert_offsets (E + 1,) int32, non-decreasing within [0, R] (as the schedule makes them; not
                   checked on the device: the offsets never leave it)
The references are the `*_reference` functions beside the ops (quantization.fp8_segment_matmul).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok import quantization
from megatron_mok.limits import FP8_BLOCK, MAX_EP_RANKS, fp8_scale_rows
from megatron_mok.ops.extension import register_fake
from megatron_mok.ops.tensor_checks import overlap

E4M3 = torch.float8_e4m3fn

# The consumers' mainloops of ops.fp8_expert_gemm, by name, in the order of the kernel's
# Fp8Mainloop (csrc/gemm/fp8_gemm_sm90.cuh, which says what each does); "wide" is another kernel,
# 128 x 192 tiles with one partial per warpgroup (csrc/gemm/fp8_gemm_wide_sm90.cuh), and
# "wide_across_tiles" that kernel with the next tile's first K block issued before a tile's epilogue,
# "wide_ordered" that kernel with its two consumer warpgroups issuing their K blocks in turn,
# "wide_ordered_across_tiles" both, and "wide_ordered_staged_scales" wide_ordered with the A scales
# brought into each pipeline stage beside its operands (a_scales then must start 16-byte aligned).
# Every one computes bitwise the same output, so the choice is speed only (backends/tuning.py's).
FP8_GEMM_VARIANTS = ("default", "pingpong", "overlap", "overlap_late_scales", "overlap_eager_retire", "wide",
                     "wide_across_tiles", "wide_ordered", "wide_ordered_across_tiles", "wide_ordered_staged_scales")
# The mainloops of ops.fp8_expert_gemm_swiglu: pingpong's turn barriers beside the SwiGLU epilogue's
# registers spill, so that instance is not built.
FP8_SWIGLU_GEMM_VARIANTS = ("default", "overlap")
# The mainloops of ops.fp8_expert_gemm_push (the instances built for it).
FP8_PUSH_GEMM_VARIANTS = ("default", "overlap", "wide", "wide_across_tiles", "wide_ordered",
                          "wide_ordered_across_tiles", "wide_ordered_staged_scales")
# The mainloops of ops.fp8_expert_gemm_swiglu_backward (the instances built for it).
FP8_SWIGLU_BACKWARD_GEMM_VARIANTS = ("default", "overlap")


@register_fake("fp8_expert_gemm")
def _fp8_expert_gemm_fake(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, variant=0):
    return a.new_empty((a.shape[0], weight.shape[1]), dtype=torch.bfloat16)


@register_fake("fp8_expert_gemm_into")
def _fp8_expert_gemm_into_fake(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, variant, out):
    return None  # writes out in place


@register_fake("fp8_expert_gemm_push")
def _fp8_expert_gemm_push_fake(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, variant,
                               slot_to_route, topk, num_tokens, own_combine, peer_combine_ptrs):
    return None  # writes the combine regions in place


@register_fake("fp8_expert_gemm_swiglu")
def _fp8_expert_gemm_swiglu_fake(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, variant=0):
    rows, ffn = a.shape[0], weight.shape[1] // 2
    return (
        a.new_empty((rows, 2 * ffn), dtype=torch.bfloat16),
        a.new_empty((rows, ffn), dtype=E4M3),
        a.new_empty((ffn // FP8_BLOCK, fp8_scale_rows(rows)), dtype=torch.float32),
    )


def fp8_expert_gemm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int,
    group_m: int,
    variant: str = "default",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(R, N) bf16: for the rows r of segment e, out[r, n] = sum over K blocks b ascending of
    a_scales[b, r] * weight_scales[e, n // 128, b] * (the fp32 sum of a[r, k] * weight[e, n, k] over
    block b), rounded once to bf16. Segment e is rows [expert_offsets[e], expert_offsets[e + 1]) of a;
    rows outside the segments (at or past expert_offsets[-1], or before expert_offsets[0]) are not
    written. So a slice expert_offsets[e0:e1 + 1] of a schedule's offsets with weight[e0:e1] multiplies
    experts e0 .. e1 - 1's rows alone, and with `out` (a (R, N) bf16 tensor, written in place and
    returned) launches over disjoint expert ranges fill one output, bitwise one launch over all of
    them (each row's sums are its own). Segments need not be aligned (a tile's rows past its segment
    are computed and not stored); the FP8 recipe pads them to 128 rows with zero rows. cluster_m (1 or
    2: CTAs sharing a weight slice through TMA multicast) and group_m (m-tiles per raster group) are the
    launch shape: backends/tuning.py FP8_EXPERT_GEMM_CLUSTER_M, FP8_EXPERT_GEMM_GROUP_M. variant: one
    of FP8_GEMM_VARIANTS (the kernel's mainloop; the same output bit for bit).
    Ref: fp8_expert_gemm_reference."""
    if variant not in FP8_GEMM_VARIANTS:
        raise ValueError(f"fp8_expert_gemm: variant must be one of {FP8_GEMM_VARIANTS}, got {variant!r}")
    check_fp8_expert_gemm_args(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, out=out,
                               more_checks=lambda: check_staged_scales_alignment("fp8_expert_gemm", variant, a_scales))
    launch = (a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, FP8_GEMM_VARIANTS.index(variant))
    if out is None:
        return torch.ops.megatron_mok.fp8_expert_gemm(*launch)
    torch.ops.megatron_mok.fp8_expert_gemm_into(*launch, out)
    return out


@register_fake("fp8_expert_gemm_swiglu_backward_into")
def _fp8_expert_gemm_swiglu_backward_into_fake(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m,
                                               variant, gate_up, grad_gate_up, rows_q, rows_scales, pow2):
    return None


def fp8_expert_gemm_swiglu_backward(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int,
    group_m: int,
    *,
    gate_up: torch.Tensor,
    pow2: bool = False,
    variant: str = "default",
    out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The down projection's dgrad with the SwiGLU backward in its epilogue: d act = fp8_expert_gemm's
    product (a (R, H) e4m3 rows of dY, weight (E, F, H) the transposed fc2 copy), rounded once to bf16
    and never written, and with gate_up (R, 2F) bf16 -> (grad_gate_up (R, 2F) bf16, rows_q (R, 2F)
    float8_e4m3fn, rows_scales (2F/128, fp8_scale_rows(R)) float32, the GEMM-A layout): bit for bit
    fp8_expert_gemm then ops.fp8_quantize_swiglu_backward on the rows of the segments, without d act in
    memory and without the second launch. Rows outside the segments are not written (the scales'
    padding columns of a new output hold 1, as gemm_a_scales makes them); with `out` (the three tensors,
    written in place and returned) launches over disjoint expert ranges (a slice of the offsets with
    the matching experts' weights) fill one output, bitwise one launch over all of them. variant: one
    of FP8_SWIGLU_BACKWARD_GEMM_VARIANTS. Ref: fp8_expert_gemm_swiglu_backward_reference."""
    op = "fp8_expert_gemm_swiglu_backward"
    if variant not in FP8_SWIGLU_BACKWARD_GEMM_VARIANTS:
        raise ValueError(f"{op}: variant must be one of {FP8_SWIGLU_BACKWARD_GEMM_VARIANTS}, got {variant!r}")
    rows = two_ffn = 0  # (set once a and weight passed their checks)
    outputs = {}
    # Checked for contiguity and device by check_fp8_expert_gemm_args after swiglu_checks, which adds
    # the outputs once their shapes passed.
    more_tensors = {"gate_up": gate_up}

    def swiglu_checks() -> None:
        nonlocal rows, two_ffn
        rows, two_ffn = a.shape[0], 2 * weight.shape[1]
        if not isinstance(pow2, bool):
            raise ValueError(f"{op}: pow2 must be a bool, got {type(pow2).__name__}")
        if not isinstance(gate_up, torch.Tensor) or gate_up.dtype != torch.bfloat16 or tuple(gate_up.shape) != (rows, two_ffn):
            raise ValueError(f"{op}: gate_up must be torch.bfloat16 (R, 2F) = {(rows, two_ffn)} (F: weight's N), "
                             f"got {_described(gate_up)}")
        if out is None:
            return
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ValueError(f"{op}: out must be None or (grad_gate_up, rows_q, rows_scales), got {_described(out)}")
        wants = (("grad_gate_up", torch.bfloat16, (rows, two_ffn)), ("rows_q", E4M3, (rows, two_ffn)),
                 ("rows_scales", torch.float32, (two_ffn // FP8_BLOCK, fp8_scale_rows(rows))))
        for t, (name, dtype, shape) in zip(out, wants):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"{op}: out's {name} must be {dtype} {shape}, got {_described(t)}")
            outputs[name] = more_tensors[name] = t
        inputs = {"a": a, "a_scales": a_scales, "weight": weight, "weight_scales": weight_scales,
                  "expert_offsets": expert_offsets, "gate_up": gate_up}
        for name, t in outputs.items():
            for other, u in [*inputs.items(), *((o, v) for o, v in outputs.items() if o != name)]:
                if overlap(t, u):
                    raise ValueError(f"{op}: out's {name} must not overlap {other} in memory")

    check_fp8_expert_gemm_args(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, op=op,
                               more_checks=swiglu_checks, more_tensors=more_tensors)
    if gate_up.data_ptr() % 16 or any(t.data_ptr() % 16 for t in outputs.values()):
        raise ValueError(f"{op}: gate_up and the outputs must start 16-byte aligned")
    if out is None:
        out = (torch.empty((rows, two_ffn), dtype=torch.bfloat16, device=a.device),
               torch.empty((rows, two_ffn), dtype=E4M3, device=a.device),
               torch.empty((two_ffn // FP8_BLOCK, fp8_scale_rows(rows)), dtype=torch.float32, device=a.device))
        out[2][:, rows:] = 1.0
    torch.ops.megatron_mok.fp8_expert_gemm_swiglu_backward_into(
        a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, FP8_GEMM_VARIANTS.index(variant),
        gate_up, *out, pow2,
    )
    return tuple(out)


def fp8_expert_gemm_swiglu_backward_reference(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    gate_up: torch.Tensor,
    pow2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8_expert_gemm_swiglu_backward through PyTorch: the recipe's product rounded to bf16, then
    fp8_quant.fp8_quantize_swiglu_backward_reference (rows at or past expert_offsets[-1] zero, scale 1;
    torch's sigmoid, which may differ from the kernels' by an ulp). Reads the offsets on the host:
    tests and references only."""
    from megatron_mok.ops import fp8_quant  # (imported when called, as fp8_quant imports this module's names)

    grad_act = fp8_expert_gemm_reference(a, a_scales, weight, weight_scales, expert_offsets).bfloat16()
    return fp8_quant.fp8_quantize_swiglu_backward_reference(gate_up, grad_act, expert_offsets, pow2)


def fp8_expert_gemm_push(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int,
    group_m: int,
    *,
    slot_to_route: torch.Tensor,
    topk: int,
    num_tokens: int,
    own_combine: torch.Tensor,
    peer_combine_ptrs: list[int],
    variant: str = "default",
) -> None:
    """fp8_expert_gemm's product pushed, in the epilogue, where ops.push_rows would move its rows:
    row s (in a segment) goes to row r % (num_tokens * topk) of rank r // (num_tokens * topk)'s combine
    region, r = slot_to_route[s] ((R,) int64; -1: not written). own_combine: this rank's region,
    (num_tokens * topk, N) bf16; peer_combine_ptrs: every rank's address of it, rank order. The same
    bytes as fp8_expert_gemm then push_rows, without the (R, N) product in memory; launches over
    disjoint expert ranges (a slice of the offsets, as fp8_expert_gemm's) push their rows alone.
    variant: one of FP8_PUSH_GEMM_VARIANTS. Ref: fp8_expert_gemm, then ops.push_rows."""
    check_fp8_expert_gemm_push_args(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m,
                                    slot_to_route, topk, num_tokens, own_combine, peer_combine_ptrs, variant)
    torch.ops.megatron_mok.fp8_expert_gemm_push(
        a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, FP8_GEMM_VARIANTS.index(variant),
        slot_to_route, topk, num_tokens, own_combine, list(peer_combine_ptrs),
    )


def check_staged_scales_alignment(op: str, variant: str, a_scales: torch.Tensor) -> None:
    """wide_ordered_staged_scales bulk-copies each K block's A scales from a 16-byte aligned row (the
    GEMM-A layout's rows are padded to a multiple of 4): a_scales itself must start 16-byte aligned (a
    fresh tensor does; a view at an offset may not)."""
    if variant == "wide_ordered_staged_scales" and a_scales.data_ptr() % 16:
        raise ValueError(f"{op}: a_scales must start 16-byte aligned for variant {variant!r}, got address "
                         f"{a_scales.data_ptr():#x}")


def check_fp8_expert_gemm_push_args(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m,
                                    slot_to_route, topk, num_tokens, own_combine, peer_combine_ptrs, variant) -> None:
    """fp8_expert_gemm_push's ValueErrors naming the argument, devices last (check_fp8_expert_gemm_args)."""
    op = "fp8_expert_gemm_push"
    if variant not in FP8_PUSH_GEMM_VARIANTS:
        raise ValueError(f"{op}: variant must be one of {FP8_PUSH_GEMM_VARIANTS}, got {variant!r}")

    def push_checks() -> None:
        rows, n = a.shape[0], weight.shape[1]
        if (not isinstance(slot_to_route, torch.Tensor) or slot_to_route.dtype != torch.int64
                or tuple(slot_to_route.shape) != (rows,)):
            raise ValueError(f"{op}: slot_to_route must be an int64 tensor of a's rows ({rows},), got "
                             f"{_described(slot_to_route)}")
        for name, value, least in (("topk", topk, 1), ("num_tokens", num_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{op}: {name} must be an int >= {least}, got {value!r}")
        if (not isinstance(own_combine, torch.Tensor) or own_combine.dtype != torch.bfloat16
                or tuple(own_combine.shape) != (num_tokens * topk, n)):
            raise ValueError(f"{op}: own_combine must be torch.bfloat16 (num_tokens * topk, N) = "
                             f"{(num_tokens * topk, n)}, got {_described(own_combine)}")
        ptrs = list(peer_combine_ptrs)
        if not (1 <= len(ptrs) <= MAX_EP_RANKS) or any(
                isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % 16 for v in ptrs):
            raise ValueError(f"{op}: peer_combine_ptrs must hold 1 to {MAX_EP_RANKS} non-null 16-byte aligned "
                             f"addresses, one per rank, got {ptrs!r}")
        if len(ptrs) * num_tokens * topk >= 1 << 31:
            raise ValueError(f"{op}: the group's routes (len(peer_combine_ptrs) * num_tokens * topk) must number "
                             f"fewer than 2^31, got {len(ptrs) * num_tokens * topk}")
        if own_combine.data_ptr() not in ptrs:
            raise ValueError(f"{op}: own_combine's address must be one of peer_combine_ptrs (this rank's region)")
        check_staged_scales_alignment(op, variant, a_scales)

    check_fp8_expert_gemm_args(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, op=op,
                               more_checks=push_checks,
                               more_tensors={"slot_to_route": slot_to_route, "own_combine": own_combine})


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def fp8_expert_gemm_reference(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
) -> torch.Tensor:
    """(R, N) float32: the same sum computed exactly as docs/design.md §12.3 states it (each K block's
    partial in fp32 from the E4M3 values, whose products are exact), before the bf16 rounding; zero at
    or past expert_offsets[-1]. Reads the offsets on the host: tests and references only."""
    return quantization.fp8_segment_matmul(a, a_scales, weight, weight_scales, expert_offsets)


def fp8_expert_gemm_swiglu(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    cluster_m: int,
    group_m: int,
    variant: str = "default",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate/up projection with SwiGLU in the epilogue, act quantized 1x128 along F for the down
    projection: weight (E, 2F, K) gate rows then up rows (F a multiple of 128), quantized 128 x 128.
    Returns (gate_up (R, 2F) bf16: fp8_expert_gemm's product; act (R, F) float8_e4m3fn and act_scales
    (F/128, fp8_scale_rows(R)) float32 in the GEMM-A layout, padding columns 1): act is
    silu(gate) * up of the bf16 gate_up rounded to bf16 (ops.swiglu_forward's arithmetic), then
    quantization.quantize_rowwise of it exactly (the same q and scales bit for bit). Rows at or past
    expert_offsets[-1] are not written. variant: one of FP8_SWIGLU_GEMM_VARIANTS, the mainloop as
    fp8_expert_gemm's (the same outputs bit for bit). Ref: fp8_expert_gemm_swiglu_reference."""
    if variant not in FP8_SWIGLU_GEMM_VARIANTS:
        raise ValueError(f"fp8_expert_gemm_swiglu: variant must be one of {FP8_SWIGLU_GEMM_VARIANTS}, got {variant!r}")
    check_fp8_expert_gemm_args(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m,
                               op="fp8_expert_gemm_swiglu", gated=True)
    return torch.ops.megatron_mok.fp8_expert_gemm_swiglu(
        a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, FP8_GEMM_VARIANTS.index(variant)
    )


def fp8_expert_gemm_swiglu_reference(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate_up (R, 2F) float32 exact, act (R, F) e4m3, act_scales (F/128, fp8_scale_rows(R))): the
    recipe's product, and act from its bf16 rounding through SwiGLU (rounded to bf16) and
    quantization.quantize_rowwise. The kernel's act equals this act of the kernel's own gate_up."""
    gate_up = fp8_expert_gemm_reference(a, a_scales, weight, weight_scales, expert_offsets)
    act, act_scales = quantize_swiglu(gate_up.bfloat16())
    return gate_up, act, act_scales


def quantize_swiglu(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up (R, 2F) bf16 -> (act (R, F) e4m3, act_scales (F/128, fp8_scale_rows(R)) fp32):
    silu(gate) * up in fp32 rounded to bf16, quantized 1x128 along F (the FP8 SwiGLU epilogue's
    result for the same gate_up)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).bfloat16()
    q, scales = quantization.quantize_rowwise(act)
    return q, quantization.gemm_a_scales(scales)


def check_fp8_expert_gemm_args(
    a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, op: str = "fp8_expert_gemm",
    gated: bool = False, out=None, more_checks=None, more_tensors: Optional[dict] = None,
) -> None:
    """ValueErrors naming the argument: types, dtypes, shapes and multiples first, contiguity, then
    devices (so everything but the device is checkable with CPU tensors). gated: weight holds F gate
    then F up rows, F a multiple of 128. out: None, or the (R, N) bf16 output to write into.
    more_checks: an op's own checks (called once a and weight are valid, before contiguity);
    more_tensors: {name: tensor} also checked for contiguity and a's device."""

    def fail(message: str) -> None:
        raise ValueError(f"{op}: {message}")

    tensors = {
        "a": a, "a_scales": a_scales, "weight": weight, "weight_scales": weight_scales, "expert_offsets": expert_offsets
    }
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a tensor, got {type(t).__name__}")
    for name, dtype in (("a", E4M3), ("weight", E4M3), ("a_scales", torch.float32), ("weight_scales", torch.float32),
                        ("expert_offsets", torch.int32)):
        if tensors[name].dtype != dtype:
            fail(f"{name} must be {dtype}, got {tensors[name].dtype}")
    if a.dim() != 2:
        fail(f"a must be (R, K), got {tuple(a.shape)}")
    if weight.dim() != 3:
        fail(f"weight must be (E, N, K), got {tuple(weight.shape)}")
    rows, k = a.shape
    experts, n, weight_k = weight.shape
    if weight_k != k:
        fail(f"weight (E, N, K) must have a's K = {k}, got {tuple(weight.shape)}")
    if experts < 1:
        fail(f"weight must hold at least one expert, got {tuple(weight.shape)}")
    if k <= 0 or k % FP8_BLOCK:
        fail(f"K (a's columns) must be a positive multiple of {FP8_BLOCK} for FP8 blockwise, got {k}")
    if n <= 0 or n % FP8_BLOCK:
        fail(f"N (weight's rows per expert) must be a positive multiple of {FP8_BLOCK} for FP8 blockwise, got {n}")
    if gated and n % (2 * FP8_BLOCK):
        fail(f"weight (E, 2F, K) must hold F gate and F up rows with F a multiple of {FP8_BLOCK}, got {n} rows")
    want = (k // FP8_BLOCK, fp8_scale_rows(rows))
    if tuple(a_scales.shape) != want:
        fail(f"a_scales must be (K/128, fp8_scale_rows(R)) = {want} (quantization.gemm_a_scales), "
             f"got {tuple(a_scales.shape)}")
    want = (experts, n // FP8_BLOCK, k // FP8_BLOCK)
    if tuple(weight_scales.shape) != want:
        fail(f"weight_scales must be (E, N/128, K/128) = {want}, got {tuple(weight_scales.shape)}")
    if tuple(expert_offsets.shape) != (experts + 1,):
        fail(f"expert_offsets must be (E + 1,) = ({experts + 1},), got {tuple(expert_offsets.shape)}")
    if isinstance(cluster_m, bool) or cluster_m not in (1, 2):
        fail(f"cluster_m must be 1 or 2, got {cluster_m!r}")
    if isinstance(group_m, bool) or not isinstance(group_m, int) or not (cluster_m <= group_m <= 1024) or group_m % cluster_m:
        fail(f"group_m must be a multiple of cluster_m in [cluster_m, 1024], got {group_m!r}")
    if fp8_scale_rows(rows) >= 1 << 31 or experts * n >= 1 << 31:
        fail(f"more than 2^31 rows (a {tuple(a.shape)}, weight {tuple(weight.shape)})")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            fail(f"out must be a tensor or None, got {type(out).__name__}")
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, n):
            fail(f"out must be torch.bfloat16 (R, N) = {(rows, n)}, got {out.dtype} {tuple(out.shape)}")
        for name, t in tensors.items():  # (the kernel reads every input while it writes out)
            if overlap(out, t):
                fail(f"out must not overlap {name} in memory")
        tensors["out"] = out
    if more_checks is not None:
        more_checks()
    tensors.update(more_tensors or {})
    for name, t in tensors.items():
        if not t.is_contiguous():
            fail(f"{name} must be contiguous")
    for name in ("a", "weight", "out"):  # (the TMA boxes' global addresses)
        if name in tensors and tensors[name].data_ptr() % 16:
            fail(f"{name} must start 16-byte aligned")
    for name, t in tensors.items():
        if t.device.type != "cuda" or t.device != a.device:
            fail(f"{name} must be a CUDA tensor on a's device ({a.device}), got {t.device}")
