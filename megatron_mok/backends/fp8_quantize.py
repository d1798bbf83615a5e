"""The FP8 quantizations the kernel backend's FP8 stages run (backends/kernel_fp8.py), in one place:
the quantization kernels ops.fp8_quantize_rows and ops.fp8_quantize_columns (csrc/quant/), each bit
for bit the function of megatron_mok/quantization.py that the reference backend runs (docs/design.md
§12.1; tests/ops/test_gpu_fp8_quant.py compares them on the GPU): one pass over the values instead
of torch's several.

Notation: R rows, C columns (a multiple of 128), E experts. None of these reads a tensor's values on
the host (no synchronization): the schedule's end row is applied on the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok import ops, quantization
from megatron_mok.ops.fp8_quant import kernel_ready
from megatron_mok.quantization import QuantizedRows

Tensor = torch.Tensor


def quantize_source_rows(x: Tensor, pow2: bool) -> QuantizedRows:
    """x (R, C) bf16 -> QuantizedRows (q (R, C) e4m3, scales (R, C/128) fp32, the source layout): what
    a rank publishes of x and dY (ops.fp8_quantize_rows with source scales only)."""
    q, scales, _ = ops.fp8_quantize_rows(kernel_ready(x), source_scales=True, gemm_a_scales=False, pow2=pow2)
    return QuantizedRows(q, scales)


def quantize_rows_gemm_a(x: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """x (R, C) bf16 -> (q (R, C) e4m3, scales (C/128, fp8_scale_rows(R)) fp32 in the GEMM-A layout):
    1x128 along C, the left operand of an FP8 GEMM (ops.fp8_quantize_rows with gemm_a_scales only).
    Rows no GEMM reads (at or past the schedule's end) may hold anything, NaN included: their blocks
    quantize to whatever, and no GEMM tile reads them."""
    q, _, gemm_a = ops.fp8_quantize_rows(x, source_scales=False, gemm_a_scales=True, pow2=pow2)
    return q, gemm_a


def gemm_a_layout(scales: Tensor) -> Tensor:
    """Row-wise scales (R, C/128) fp32 -> the GEMM-A layout (C/128, fp8_scale_rows(R)), padding
    columns 1 (what ops.fp8_quantize_rows writes with gemm_a_scales)."""
    return quantization.gemm_a_scales(scales)


def quantize_columns(
    x: Tensor, expert_offsets: Tensor, pow2: bool, row_index: Optional[Tensor] = None,
    row_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """x (R, C) bf16, the rows of a schedule (or of a window of it) -> (q (C, R_pad) e4m3, scales
    (R_pad/128, C) fp32), 1x128 along the rows (tokens), R_pad = R rounded up to 128: a weight
    gradient's operand (ops.fp8_quantize_columns). Rows at or past expert_offsets[-1] ((E + 1,) int32,
    read on the device) and the padding rows quantize as zeros, whatever their memory holds: the
    kernel stages leave the rows past the schedule's end unwritten. With row_index (R,) int64, x is
    the source (R_src, C) and row r is x[row_index[r]] (-1: zeros), gathered by the kernel; with
    row_weights (R,) float32 too, times row_weights[r] (each value rounded to bf16, the weighted
    pull's w * dY)."""
    if row_index is None:
        return ops.fp8_quantize_columns(x, expert_offsets, pow2=pow2)
    return ops.fp8_quantize_columns(kernel_ready(x), expert_offsets, pow2=pow2, row_index=row_index, row_weights=row_weights)


def quantize_columns_from_peers(
    own: Tensor, peer_ptrs: tuple[int, ...], expert_offsets: Tensor, pow2: bool, row_index: Tensor,
    row_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """quantize_columns of the group's rows where they lie, in the ranks' symmetric regions: own
    (T, C) bf16 this rank's copy, peer_ptrs every rank's address of it, row_index (R,) int64 rows of
    the group (g: rank g // T's row g % T) (ops.fp8_quantize_columns_from_peers)."""
    return ops.fp8_quantize_columns_from_peers(own, list(peer_ptrs), expert_offsets, pow2=pow2, row_index=row_index,
                                               row_weights=row_weights)
