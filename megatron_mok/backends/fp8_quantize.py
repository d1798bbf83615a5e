"""The FP8 quantizations the kernel backend's FP8 stages run (backends/kernel_fp8.py), in one place:
today megatron_mok/quantization.py's torch functions (bit for bit the recipe, docs/design.md §12.1),
each with the signature of the quantization kernel that replaces it (ops.fp8_quantize_rows,
ops.fp8_quantize_columns), so that swapping the kernels in changes this file only.

Notation: R rows, C columns (a multiple of 128), E experts. None of these reads a tensor's values on
the host (no synchronization): the schedule's end row is applied on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_mok import quantization
from megatron_mok.limits import FP8_BLOCK

Tensor = torch.Tensor


def quantize_rows_gemm_a(x: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """x (R, C) bf16 -> (q (R, C) e4m3, scales (C/128, fp8_scale_rows(R)) fp32 in the GEMM-A layout):
    1x128 along C, the left operand of an FP8 GEMM (ops.fp8_quantize_rows with gemm_a_scales only).
    Rows no GEMM reads (at or past the schedule's end) may hold anything, NaN included: their blocks
    quantize to whatever, and no GEMM tile reads them."""
    q, scales = quantization.quantize_rowwise(x, pow2)
    return q, quantization.gemm_a_scales(scales)


def gemm_a_layout(scales: Tensor) -> Tensor:
    """Row-wise scales (R, C/128) fp32 -> the GEMM-A layout (C/128, fp8_scale_rows(R)), padding
    columns 1 (what ops.fp8_quantize_rows writes with gemm_a_scales)."""
    return quantization.gemm_a_scales(scales)


def quantize_columns(x: Tensor, expert_offsets: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """x (R, C) bf16, the rows of a schedule (or of a window of it) -> (q (C, R_pad) e4m3, scales
    (R_pad/128, C) fp32), 1x128 along the rows (tokens), R_pad = R rounded up to 128: a weight
    gradient's operand (ops.fp8_quantize_columns). Rows at or past expert_offsets[-1] ((E + 1,) int32,
    read on the device) and the padding rows quantize as zeros, whatever their memory holds: the
    kernel stages leave the rows past the schedule's end unwritten."""
    rows = x.shape[0]
    padded = -(-rows // FP8_BLOCK) * FP8_BLOCK
    in_schedule = torch.arange(rows, device=x.device) < expert_offsets[-1]
    x = torch.where(in_schedule.unsqueeze(1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return quantization.quantize_columnwise(F.pad(x, (0, 0, 0, padded - rows)), pow2)
