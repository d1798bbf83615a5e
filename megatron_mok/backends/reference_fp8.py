"""The reference backend's FP8 blockwise stages (MoKConfig.precision="fp8_blockwise"): the recipe of
docs/design.md §12, exactly, in PyTorch, from the pieces of megatron_mok/quantization.py. The oracle
of the FP8 kernels; runs anywhere (CPU included), without a host synchronization.

Shapes: capacity = the schedule's rows (every segment starts and ends at a multiple of 128 rows:
functional raises the schedule's alignment to a multiple of 128 for FP8); H hidden; F ffn_hidden;
E local experts. Per stage (everything not named here is the bf16 reference's, backends/reference.py):

    dispatch_gate_up   the source's FP8 rows (x, quantized 1x128 along H where its rank published
                       it) gathered -> gate_up = FP8 GEMM with fc1 (128x128), rounded to the
                       activation dtype -> act = SwiGLU (fp32, rounded once) -> act quantized 1x128
                       along F
    expert_down        FP8 GEMM of act with fc2 -> rows in the activation dtype (pushed, combined in
                       fp32 as bf16's are)
    pull_route_grads   from an FP8 dY source: the route's dY row, its E4M3 values as published and its
                       scales times w; from a dY source in the activation dtype, bf16's (the d fc2
                       weight gradient's operand)
    dgrad_swiglu       FP8 GEMM of those rows with fc2 transposed (E, F, H) -> d act, rounded to the
                       activation dtype -> the SwiGLU backward with gate_up (fp32, rounded once)
    dgrad_rows         d gate_up quantized 1x128 along 2F -> FP8 GEMM with fc1 transposed (E, H, 2F)
                       -> d rows in the activation dtype (pushed back as bf16's are)
    weight gradients   FP8: both operands quantized 1x128 along tokens (column-wise) from the
                       activation-dtype values (w * dY and act; d gate_up and the rows of x), blocks
                       added in row order into one fp32 total (weight_grads.Fp32Carried), rounded
                       once; or (Fp8Recipe.weight_grad False) bf16's segment_weight_grad

Every FP8 GEMM's output is rounded once to the activation dtype, as bf16's GEMM stages are, so the
FP8 and bf16 stages hand over the same dtypes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_mok import fp8_weights
from megatron_mok.backends import reference
from megatron_mok.backends.stages import Stages
from megatron_mok.limits import FP8_BLOCK
from megatron_mok.quantization import (
    Fp8Recipe,
    QuantizedRows,
    fp8_grouped_matmul,
    fp8_grouped_weight_grad,
    quantize_columnwise,
)
from megatron_mok.schedule import Schedule, take_rows

Tensor = torch.Tensor


def _route_rows(schedule: Schedule) -> tuple[Tensor, Tensor]:
    """(route (capacity,) int64 with 0 for padding rows, valid (capacity,) bool)."""
    route = schedule.slot_to_route
    valid = route >= 0
    return torch.where(valid, route, 0), valid


def dispatch_rows(source, schedule: Schedule):
    """The pull dispatch of FP8 rows or rows in the activation dtype, whichever the source holds.
    Returns (capacity, H); padding rows zero (FP8: all-zero blocks, scale 1)."""
    rows_all = source.materialize()
    if not isinstance(rows_all, QuantizedRows):
        return reference.dispatch_rows(source, schedule)
    route, valid = _route_rows(schedule)
    return rows_all.gather(route // schedule.topk, valid)


def _matmul(rows: QuantizedRows, weight, offsets: Tensor, dtype: torch.dtype) -> Tensor:
    """rows (capacity, K) FP8 times weight (a fp8_weights.QuantizedWeight (E, N, K)) per segment ->
    (capacity, N) in dtype."""
    return fp8_grouped_matmul(rows.values, rows.scales, weight.values, weight.scales, offsets).to(dtype)


def dispatch_gate_up(source, schedule: Schedule, fc1: Tensor, ring_minibatches: int, *, recipe: Fp8Recipe):
    """-> (rows (capacity, H) FP8, gate_up (capacity, 2F) in fc1's dtype, act (capacity, F) FP8).
    ring_minibatches (the kernel's bound) does not apply."""
    rows = dispatch_rows(source, schedule)
    offsets = schedule.expert_offsets
    gate_up = _matmul(rows, fp8_weights.quantized(fc1, recipe.pow2_scales, cache=recipe.cache_weights), offsets, fc1.dtype)
    act = reference.swiglu(gate_up, offsets)
    return rows, gate_up, QuantizedRows.quantize(act, recipe.pow2_scales)


def expert_down(act: QuantizedRows, fc2: Tensor, offsets: Tensor, *, recipe: Fp8Recipe) -> Tensor:
    """act (capacity, F) FP8 -> (capacity, H) in fc2's dtype."""
    return _matmul(act, fp8_weights.quantized(fc2, recipe.pow2_scales, cache=recipe.cache_weights), offsets, fc2.dtype)


def pull_route_grads(source, schedule: Schedule):
    """w[route] * dY[route // K] per row: FP8 (dY's E4M3 values, its scales times w) from an FP8 dY
    source, else bf16's. Padding rows zero."""
    grad_y_all, weights_all = source.materialize()
    if not isinstance(grad_y_all, QuantizedRows):
        return reference.pull_route_grads(source, schedule)
    route, valid = _route_rows(schedule)
    weight = take_rows(weights_all, route)
    return grad_y_all.gather(route // schedule.topk, valid, scale_factor=weight)


def dgrad_swiglu(grad_out: QuantizedRows, fc2: Tensor, gate_up: Tensor, offsets: Tensor, *, recipe: Fp8Recipe) -> Tensor:
    """grad_out (capacity, H) FP8 -> d gate_up (capacity, 2F) in gate_up's dtype."""
    grad_act = _matmul(grad_out, fp8_weights.quantized_transposed(fc2, recipe.pow2_scales, cache=recipe.cache_weights), offsets, gate_up.dtype)
    return reference.swiglu_backward(gate_up, grad_act, offsets)


def dgrad_rows(grad_gate_up: Tensor, fc1: Tensor, offsets: Tensor, *, recipe: Fp8Recipe) -> Tensor:
    """d gate_up (capacity, 2F) -> d rows (capacity, H) in its dtype, through its 1x128 quantization."""
    grad = QuantizedRows.quantize(grad_gate_up, recipe.pow2_scales)
    return _matmul(grad, fp8_weights.quantized_transposed(fc1, recipe.pow2_scales, cache=recipe.cache_weights), offsets, grad_gate_up.dtype)


def _columnwise(t: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """t (capacity, C) -> its 1x128 quantization along the rows, the rows padded with zeros to a
    multiple of 128 (a window's rows are; a whole schedule's need not be)."""
    rows = -(-t.shape[0] // FP8_BLOCK) * FP8_BLOCK
    return quantize_columnwise(F.pad(t, (0, 0, 0, rows - t.shape[0])), pow2)


def weight_grad_into(grad_out: Tensor, inputs: Tensor, offsets: Tensor, total: Tensor, *, recipe: Fp8Recipe) -> None:
    """grad_out (capacity, N), inputs (capacity, K) in the activation dtype: both quantized 1x128
    along the rows, the segments' FP8 weight gradients added into total (E + 1, N, K) fp32."""
    fp8_grouped_weight_grad(*_columnwise(grad_out, recipe.pow2_scales), *_columnwise(inputs, recipe.pow2_scales), offsets, total)


def segment_weight_grad(grad_out: Tensor, inputs: Tensor, offsets: Tensor, *, recipe: Fp8Recipe) -> Tensor:
    """The FP8 weight gradients of one pass over the rows: (E, N, K) in grad_out's dtype."""
    total = grad_out.new_zeros((offsets.shape[0], grad_out.shape[1], inputs.shape[1]), dtype=torch.float32)
    weight_grad_into(grad_out, inputs, offsets, total, recipe=recipe)
    return total[:-1].to(grad_out.dtype)


@functools.cache
def reference_fp8_stages(recipe: Fp8Recipe) -> Stages:
    """The reference backend's stage table for one FP8 recipe."""
    bind = lambda stage: functools.partial(stage, recipe=recipe)  # noqa: E731
    if recipe.weight_grad:
        weight_grads = dict(
            segment_weight_grad=bind(segment_weight_grad), weight_grad_into=bind(weight_grad_into), weight_grad_family="fp32_carried"
        )
    else:
        weight_grads = dict(segment_weight_grad=reference.segment_weight_grad, weight_grad_family="reference")
    return Stages(
        dispatch_rows=dispatch_rows,
        dispatch_gate_up=bind(dispatch_gate_up),
        expert_down=bind(expert_down),
        segment_matmul=reference.segment_matmul,
        swiglu=reference.swiglu,
        swiglu_backward=reference.swiglu_backward,
        dgrad_swiglu=bind(dgrad_swiglu),
        dgrad_rows=bind(dgrad_rows),
        combine=reference.combine,
        pull_route_grads=pull_route_grads,
        route_weight_grads=reference.route_weight_grads,
        **weight_grads,
    )
