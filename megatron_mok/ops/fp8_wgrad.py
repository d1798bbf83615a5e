"""The FP8 blockwise weight gradient of the expert projections (csrc/gemm/fp8_wgrad_sm90.cuh; docs/design.md
§12.3), tokens as the reduction dimension, accumulated in fp32 across receive windows.

Notation: R rows of a window of the schedule (the whole schedule: one window), E experts, m and n the
weight gradient's rows and columns (d fc1: m = 2F from d gate_up, n = H from the rows of x; d fc2:
m = H from w dY, n = F from act). Both operands are column-wise (quantization.quantize_columnwise of
the high-precision (R, m) and (R, n) values: tokens contiguous, one scale per column and 128 tokens):
    grad           (m, R) float8_e4m3fn
    grad_scales    (R/128, m) float32
    inputs         (n, R) float8_e4m3fn
    inputs_scales  (R/128, n) float32
    expert_offsets (E + 1,) int32: the whole schedule's segments, non-decreasing from 0 (not checked on
                   the device). Every segment with rows in the window starts on a 128-row block of it
                   (the FP8 schedule pads segments to 128 rows: checked on the device, a failure is
                   recorded, ops.last_failure(), and traps), and the rows of its last block past its
                   end are padding rows, zero in both operands (not checked).
    out            (E, m, n) float32
    rounded        (E, m, n) bfloat16, optional: the result rounded, instead of written to out
The reference is fp8_expert_wgrad_reference (quantization.fp8_segment_weight_grad).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok import quantization
from megatron_mok.limits import FP8_BLOCK
from megatron_mok.ops.extension import register_fake
from megatron_mok.ops.tensor_checks import overlap

E4M3 = torch.float8_e4m3fn


# The kernel's mainloops (csrc/gemm/fp8_wgrad_sm90.cuh Fp8WgradMainloop, in its order): "overlap" keeps
# two partial sums per warpgroup, so one block is promoted while the next runs; "overlap_across_tiles"
# also issues the next tile's first block before a tile's epilogue. Then "wide", a kernel of its own
# (csrc/gemm/fp8_wgrad_wide_sm90.cuh): 128 x 192 tiles, one partial per warpgroup, the next tile's
# first block issued before the epilogue, and "wide_ordered", that kernel with its two consumer
# warpgroups issuing their blocks in turn. All bitwise the default's (tests/ops/test_gpu_fp8_wgrad.py
# holds them to the default bit for bit, receive windows and reruns included).
FP8_WGRAD_VARIANTS = ("default", "overlap", "overlap_across_tiles", "wide", "wide_ordered")


@register_fake("fp8_expert_wgrad")
def _fp8_expert_wgrad_fake(grad, grad_scales, inputs, inputs_scales, expert_offsets, window_begin, accumulate, out,
                           rounded_out, carry_in, carry_out, variant):
    return None  # writes out, rounded_out or carry_out in place


def fp8_expert_wgrad(
    grad: torch.Tensor,
    grad_scales: torch.Tensor,
    inputs: torch.Tensor,
    inputs_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    *,
    accumulate: bool = False,
    window_begin: int = 0,
    rounded: Optional[torch.Tensor] = None,
    carry: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    variant: str = "default",
) -> torch.Tensor:
    """out (E, m, n) float32, written in place (allocated when None and no `rounded` is given, which
    needs accumulate=False) and returned: for each expert e, with e's rows in the window
    [window_begin, window_begin + R) taken in blocks b of 128 rows, ascending,
        out[e] = (out[e] if accumulate else 0) + sum_b grad_scales[b, :, None] * inputs_scales[b, None, :] * P_b,
        P_b    = the fp32 sum over block b's rows r of grad[:, r] outer inputs[:, r] (E4M3 products, exact),
    accumulated as acc = fma(grad_scale * inputs_scale, P_b, acc) from acc = out[e] or 0. An expert with no
    row in the window gets zeros (accumulate=False) or is left as it is (accumulate=True).

    rounded: (E, m, n) bfloat16. When given, the sums are written there instead, each rounded once to
    nearest even (bitwise the fp32 result converted), and returned; out is then only read (the chains'
    start, accumulate=True) and may be None without accumulate: no fp32 copy of the gradient exists.

    Receive windows: call it for the windows of the schedule in order, the first with accumulate=False
    and the rest with accumulate=True, each with its own rows' operands and window_begin (a multiple of
    128), the last one with `rounded` if the bf16 gradient is wanted: the result ends bitwise equal to one
    call over all the rows, whatever the windows (each expert's fp32 chain continues from where the
    previous window stored it).

    carry: (carry_in, carry_out), two distinct (m, n) float32 buffers: the windowed form, for passes of
    several windows (with `rounded`, without out and accumulate). Call it for the windows in order,
    tiling the schedule's rows from row 0 to at least expert_offsets[-1] (each window_begin the previous
    window's end, the offsets non-decreasing), carry_out of
    one window being carry_in of the next (two buffers used in turn). Per expert e with segment
    [o_e, o_e+1) of expert_offsets: its chain starts from carry_in if o_e < window_begin, else from 0;
    it ends rounded into rounded[e] in the window with o_e+1 <= window_begin + R (an empty expert: the
    window at row 0), else goes on into carry_out; a window with none of e's rows leaves rounded[e]
    alone. After the last window `rounded` is bitwise one call's (the same chains, each rounded once),
    each tile was read and written only by windows holding its expert's rows, and the fp32 state
    between windows is one carry of (m, n) instead of an (E, m, n) total. Returns rounded.

    variant: one of FP8_WGRAD_VARIANTS, the kernel's mainloop (speed only).
    Ref: fp8_expert_wgrad_reference."""
    check_fp8_expert_wgrad_args(grad, grad_scales, inputs, inputs_scales, expert_offsets, out, accumulate, window_begin,
                                rounded, variant, carry)
    carry_in, carry_out = carry if carry is not None else (None, None)
    if out is None and rounded is None:
        out = grad.new_empty((expert_offsets.shape[0] - 1, grad.shape[0], inputs.shape[0]), dtype=torch.float32)
    torch.ops.megatron_mok.fp8_expert_wgrad(
        grad, grad_scales, inputs, inputs_scales, expert_offsets, window_begin, accumulate, out, rounded, carry_in,
        carry_out, FP8_WGRAD_VARIANTS.index(variant),
    )
    return out if rounded is None else rounded


def fp8_expert_wgrad_reference(
    grad: torch.Tensor,
    grad_scales: torch.Tensor,
    inputs: torch.Tensor,
    inputs_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    window_begin: int = 0,
) -> torch.Tensor:
    """(E, m, n) float32: the window's contribution computed exactly as docs/design.md §12.3 states it
    (each block's partial in fp32 from the E4M3 values, out += (sa * sb) * P_b block by block from
    zero); zeros for an expert with no row in the window. The kernel agrees with it to the tensor
    cores' accumulation within a block and fp32 rounding (its fma takes the product unrounded; with
    accumulate its chain starts from out instead of adding the contribution to it). Reads the offsets on
    the host: tests and references only."""
    rows = grad.shape[1]
    local = (expert_offsets.long() - window_begin).clamp(0, rows)
    return quantization.fp8_segment_weight_grad(grad, grad_scales, inputs, inputs_scales, local)


def check_fp8_expert_wgrad_args(
    grad, grad_scales, inputs, inputs_scales, expert_offsets, out, accumulate, window_begin, rounded=None,
    variant="default", carry=None,
) -> None:
    """ValueErrors naming the argument: types, dtypes, shapes and multiples of 128 first, then the
    flags, contiguity, then devices (so everything but the device is checkable with CPU tensors)."""

    def fail(message: str) -> None:
        raise ValueError(f"fp8_expert_wgrad: {message}")

    tensors = {
        "grad": grad, "grad_scales": grad_scales, "inputs": inputs, "inputs_scales": inputs_scales,
        "expert_offsets": expert_offsets,
    }
    if out is not None:
        tensors["out"] = out
    if rounded is not None:
        tensors["rounded"] = rounded
    if carry is not None:
        if not isinstance(carry, (tuple, list)) or len(carry) != 2:
            fail(f"carry must be a pair (carry_in, carry_out), got {type(carry).__name__}")
        tensors["carry_in"], tensors["carry_out"] = carry
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a tensor, got {type(t).__name__}")
    for name, dtype in (("grad", E4M3), ("inputs", E4M3), ("grad_scales", torch.float32),
                        ("inputs_scales", torch.float32), ("expert_offsets", torch.int32), ("out", torch.float32),
                        ("rounded", torch.bfloat16), ("carry_in", torch.float32), ("carry_out", torch.float32)):
        if name in tensors and tensors[name].dtype != dtype:
            fail(f"{name} must be {dtype}, got {tensors[name].dtype}")
    if grad.dim() != 2:
        fail(f"grad must be (m, R) (column-wise: tokens contiguous), got {tuple(grad.shape)}")
    if inputs.dim() != 2:
        fail(f"inputs must be (n, R) (column-wise: tokens contiguous), got {tuple(inputs.shape)}")
    m, rows = grad.shape
    n = inputs.shape[0]
    if inputs.shape[1] != rows:
        fail(f"inputs (n, R) must have grad's R = {rows} rows of the window, got {tuple(inputs.shape)}")
    if rows % FP8_BLOCK:
        fail(f"R (the window's rows, grad's columns) must be a multiple of {FP8_BLOCK}, got {rows}")
    if m <= 0 or m % FP8_BLOCK:
        fail(f"m (grad's rows) must be a positive multiple of {FP8_BLOCK} for FP8 blockwise, got {m}")
    if n <= 0 or n % FP8_BLOCK:
        fail(f"n (inputs' rows) must be a positive multiple of {FP8_BLOCK} for FP8 blockwise, got {n}")
    for name, cols in (("grad_scales", m), ("inputs_scales", n)):
        want = (rows // FP8_BLOCK, cols)
        if tuple(tensors[name].shape) != want:
            fail(f"{name} must be (R/128, {'m' if name == 'grad_scales' else 'n'}) = {want} "
                 f"(quantization.quantize_columnwise), got {tuple(tensors[name].shape)}")
    if expert_offsets.dim() != 1 or expert_offsets.shape[0] < 2:
        fail(f"expert_offsets must be (E + 1,) with E >= 1, got {tuple(expert_offsets.shape)}")
    experts = expert_offsets.shape[0] - 1
    for name in ("out", "rounded"):
        if name in tensors and tuple(tensors[name].shape) != (experts, m, n):
            fail(f"{name} must be (E, m, n) = {(experts, m, n)}, got {tuple(tensors[name].shape)}")
    if not isinstance(accumulate, bool):
        fail(f"accumulate must be a bool, got {type(accumulate).__name__}")
    if accumulate and out is None:
        fail("accumulate=True adds to out: out must be given")
    if carry is not None:
        for name in ("carry_in", "carry_out"):
            if tuple(tensors[name].shape) != (m, n):
                fail(f"{name} must be (m, n) = {(m, n)}, got {tuple(tensors[name].shape)}")
        if rounded is None or out is not None or accumulate:
            fail("carry (the windowed form) takes rounded, without out and accumulate")
        named = [("carry_in", tensors["carry_in"]), ("carry_out", tensors["carry_out"]), ("rounded", rounded)]
        for i, (a_name, a) in enumerate(named):
            for b_name, b in named[i + 1:]:
                if overlap(a, b):
                    fail(f"{a_name} and {b_name} must not overlap in memory (a window reads one carry while it "
                         "writes the other and the result)")
    if variant not in FP8_WGRAD_VARIANTS:
        fail(f"variant must be one of {FP8_WGRAD_VARIANTS}, got {variant!r}")
    if out is not None and rounded is not None and overlap(out, rounded):
        fail("out and rounded must not overlap in memory (out is read while rounded is written)")
    if isinstance(window_begin, bool) or not isinstance(window_begin, int):
        fail(f"window_begin must be an int, got {type(window_begin).__name__}")
    if window_begin < 0 or window_begin % FP8_BLOCK:
        fail(f"window_begin must be a non-negative multiple of {FP8_BLOCK} (a window starts on a block of "
             f"every segment it splits), got {window_begin}")
    if window_begin + rows >= 1 << 31 or experts * m >= 1 << 31:
        # (the rounded result is stored by TMA at row expert * m + m0 of an (E * m, n) view)
        fail(f"window_begin + R and E * m must be below 2^31, got {window_begin + rows} and {experts * m}")
    for name, t in tensors.items():
        if not t.is_contiguous():
            fail(f"{name} must be contiguous")
        if t.data_ptr() % 16:
            fail(f"{name} must start 16-byte aligned (TMA and bulk copies), got address {t.data_ptr():#x}")
    for name, t in tensors.items():
        if t.device.type != "cuda" or t.device != grad.device:
            fail(f"{name} must be a CUDA tensor on grad's device ({grad.device}), got {t.device}")
