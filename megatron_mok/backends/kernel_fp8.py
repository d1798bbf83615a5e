"""The kernel backend's FP8 blockwise stages (MoKConfig.precision="fp8_blockwise"): the recipe of
docs/design.md §12 through megatron_mok.ops, stage for stage what backends/reference_fp8.py computes
in PyTorch. The schedule, the combine, the BF16 data movement and the exchange are the BF16 kernel
backend's (backends/kernel.py); the quantizations go through backends/fp8_quantize.py (the quantization
kernels, one entry point).

Shapes: capacity = the schedule's rows, every segment starting and ending at a multiple of 128 rows
(functional raises the alignment for FP8); H hidden; F ffn_hidden; E local experts. The activation
dtype is bf16 (the kernel backend's). Per stage:

    dispatch_gate_up   the source's FP8 rows (x quantized 1x128 along H where its rank published it)
                       and their scales gathered into the segments by the dispatch kernel (the E4M3
                       bytes moved as bf16 pairs, bit for bit; padding rows zero bytes, scale 0) ->
                       ops.fp8_expert_gemm: gate_up bf16 -> ops.fp8_quantize_swiglu: act quantized
                       1x128 along F; or (tuning.FP8_ACT_QUANTIZE "gemm_epilogue", IEEE scales)
                       ops.fp8_expert_gemm_swiglu, act quantized in the GEMM's epilogue; the same
                       bytes either way in the rows before the schedule's end (the only ones read)
    recompute_gate_up  backward's gate/up of a window after the first: the dispatch and the GEMM of
                       dispatch_gate_up, bitwise its gate_up, without the act quantization (the fc2
                       weight gradient quantizes act from gate_up: ActColumns)
    expert_down        ops.fp8_expert_gemm of act with fc2 -> bf16 rows (pushed, combined as bf16's);
                       over the in-kernel exchange (tuning.FP8_PUSH_IN_EPILOGUE) expert_down_pushed:
                       ops.fp8_expert_gemm_push, the rows written into the sources' combine regions
                       by the GEMM's epilogue, never into this rank's memory
    pull_route_grads   from an FP8 dY source: the route's E4M3 dY row as published, its scales times w
                       (the weighted pull kernel on the fp32 scales: one fp32 multiply, the
                       reference's); from a bf16 source, bf16's
    dgrad_swiglu       ops.fp8_expert_gemm with fc2 transposed (E, F, H) (expert range by range, each
                       range's copy, of its experts with rows in the window, freed after its GEMM;
                       with Fp8Recipe.cache_transposed_weights the cache's whole copy, one launch)
                       -> d act bf16 -> with FP8
                       weight gradients ops.fp8_quantize_swiglu_backward: d gate_up bf16 and its
                       quantization 1x128 along 2F in one pass, then its quantization 1x128 along the
                       rows, the bf16 values freed (GradGateUp: both FP8 copies; with
                       tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS both from one pass,
                       ops.fp8_quantize_swiglu_backward_copies, no bf16 values; dgrad_swiglu_and_act,
                       with tuning.FP8_ACT_COLUMNS_IN_ONE_PASS too, act's column copy from that
                       pass as well); with BF16 ones the
                       SwiGLU backward kernel (bf16 d gate_up, the BF16 weight gradient's operand)
    dgrad_rows         d gate_up quantized 1x128 along 2F (the SwiGLU backward's, or quantized here) ->
                       ops.fp8_expert_gemm with fc1 transposed (E, H, 2F) (as dgrad_swiglu: by expert
                       range) -> d rows bf16 (pushed back
                       as bf16's; over the in-kernel exchange dgrad_rows_pushed, as expert_down_pushed)
    weight gradients   FP8 (Fp8Recipe.weight_grad): both operands quantized 1x128 along tokens from the
                       bf16 values (fc1's rows straight from the source x and fc2's w * dY straight
                       from dY and the route weights, never gathered into a (capacity, H) copy:
                       RowsToGather; fc2's act from gate_up: ActColumns) ->
                       ops.fp8_expert_wgrad, the fp32 sums
                       rounded once into the bf16 result in the kernel; over several receive windows
                       one fp32 (E, m, n) carried from window to window (bitwise one pass), the last
                       window rounding it; or the BF16 kernel's weight gradients

A padding row's scale is 0 here where the reference writes 1: its E4M3 bytes are zero, so every
product it enters is 0 either way. Rows at or past the schedule's end are left unwritten, as the
BF16 kernel stages leave them; no stage reads them (the column-wise quantization zeroes them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from megatron_mok import fp8_weights, ops
from megatron_mok.backends import kernel, tuning
from megatron_mok.backends.fp8_quantize import (
    gemm_a_layout, quantize_columns, quantize_columns_from_peers, quantize_rows_gemm_a, quantize_source_rows,
)
from megatron_mok.ops.fp8_quant import kernel_ready
from megatron_mok.backends.stages import Stages
from megatron_mok.backends.tuning import EXPERT_GEMM_CHOICES
from megatron_mok.comm.exchange import GradSource, PushTarget, RowSource
from megatron_mok.quantization import Fp8Recipe, QuantizedRows, as_bf16_pairs, from_bf16_pairs
from megatron_mok.schedule import Schedule

Tensor = torch.Tensor

@dataclasses.dataclass(frozen=True)
class GemmOperand:
    """An FP8 GEMM's left operand as the kernels take it, handed from one FP8 stage to the next (act,
    from dispatch_gate_up to expert_down): values (R, K) e4m3; scales (K/128, fp8_scale_rows(R)) fp32,
    the GEMM-A layout (quantization.gemm_a_scales)."""

    values: Tensor
    scales: Tensor


def _launch() -> dict:
    """The FP8 GEMMs' launch shape, tuning's at the call (a benchmark may set another)."""
    return dict(cluster_m=tuning.FP8_EXPERT_GEMM_CLUSTER_M, group_m=tuning.FP8_EXPERT_GEMM_GROUP_M)


def _gemm(values: Tensor, gemm_a_scales: Tensor, weight: fp8_weights.QuantizedWeight, offsets: Tensor,
          out: Optional[Tensor] = None, push: Optional[PushTarget] = None) -> Optional[Tensor]:
    """(capacity, K) e4m3 rows times weight (E, N, K) per segment -> (capacity, N) bf16 (into out), or
    with push those rows written where the target says (ops.fp8_expert_gemm_push) and None."""
    if push is not None:
        ops.fp8_expert_gemm_push(
            values, gemm_a_scales, weight.values, weight.scales, offsets, **_launch(),
            slot_to_route=push.slot_to_route, topk=push.topk, num_tokens=push.num_tokens, own_combine=push.own,
            peer_combine_ptrs=list(push.peer_ptrs), variant=tuning.FP8_PUSH_GEMM_VARIANT,
        )
        return None
    return ops.fp8_expert_gemm(
        values, gemm_a_scales, weight.values, weight.scales, offsets, **_launch(),
        variant=tuning.FP8_EXPERT_GEMM_VARIANT, out=out,
    )


def _dgrad(values: Tensor, gemm_a_scales: Tensor, weight: Tensor, offsets: Tensor, *, recipe: Fp8Recipe,
           push: Optional[PushTarget] = None) -> Optional[Tensor]:
    """(capacity, N) e4m3 rows times weight (E, N, K) bf16 per segment -> (capacity, K) bf16, through the
    weight's transposed FP8 copy (E, K, N): the cache's whole copy in one launch where it keeps one
    (_kept_transposed), else range of experts by range (_gemm_by_expert_ranges). A
    range's copy holds only its experts with rows in `offsets` (fp8_weights.transposed_experts): the
    windows of a backward over several receive windows transpose each expert about once in all and
    hold no copy between them."""
    kept = _kept_transposed(weight, recipe)
    if kept is not None:  # (one launch: bitwise the ranges', every row's sums are its own)
        return _gemm(values, gemm_a_scales, kept, offsets, push=push)
    copy_of = functools.partial(fp8_weights.transposed_experts, weight, pow2=recipe.pow2_scales,
                                cache=recipe.cache_weights)
    return _gemm_by_expert_ranges(values, gemm_a_scales, offsets, weight.shape[0], weight.shape[2], copy_of, push)


def _kept_transposed(weight: Tensor, recipe: Fp8Recipe) -> Optional[fp8_weights.QuantizedWeight]:
    """The weight's whole transposed copy as the cache keeps it (Fp8Recipe.cache_transposed_weights),
    or None: without the option, or where nothing is cacheable (a CUDA-graph capture), the dgrads
    make their copies range of experts by range."""
    if not (recipe.cache_transposed_weights and recipe.cache_weights):
        return None
    return fp8_weights.kept_transposed(weight, recipe.pow2_scales)


def _gemm_by_expert_ranges(values: Tensor, gemm_a_scales: Tensor, offsets: Tensor, num_experts: int,
                           out_columns: int, copy_of, push: Optional[PushTarget] = None) -> Optional[Tensor]:
    """(capacity, K) e4m3 rows times a weight copy made range of experts by range
    (tuning.FP8_DGRAD_EXPERT_RANGES ranges) -> (capacity, out_columns) bf16: each range's copy
    (copy_of(first, end, expert_offsets=offsets[first:end + 1]), a QuantizedWeight of experts
    [first, end)) is made, multiplied on the range's offsets into the one output and freed, so at most
    a range's share of the copy exists at once; bitwise one launch over the whole copy (every row's
    sums are its own). With push: each range's rows written where the target says, None returned."""
    span = tuning.fp8_dgrad_expert_span(num_experts)
    if span >= num_experts:
        return _gemm(values, gemm_a_scales, copy_of(0, num_experts, expert_offsets=offsets), offsets, push=push)
    out = None if push is not None else torch.empty((values.shape[0], out_columns), dtype=torch.bfloat16, device=values.device)
    for first in range(0, num_experts, span):
        end = min(num_experts, first + span)
        range_offsets = offsets[first:end + 1]
        copy = copy_of(first, end, expert_offsets=range_offsets)
        _gemm(values, gemm_a_scales, copy, range_offsets, out=out, push=push)
        del copy  # (before the next range's copy is made)
    return out


def _gather_values(values_all: Tensor, schedule: Schedule) -> Tensor:
    """values_all (N, H) e4m3 -> (capacity, H) e4m3 in schedule order through the dispatch kernel: its
    bf16 form copies 16-bit pairs unchanged (no arithmetic without weights), and a zero bf16 pair is
    two E4M3 zeros (H is even: a multiple of 128)."""
    rows = ops.dispatch_rows(as_bf16_pairs(values_all), schedule.slot_to_route, schedule.topk, schedule.expert_offsets)
    return from_bf16_pairs(rows)


def _fp8_source(source: RowSource) -> Optional[QuantizedRows]:
    """The source's FP8 rows (gathered, or this rank's copy of the symmetric regions), or None for
    rows in the activation dtype."""
    return source.tensor if isinstance(source.tensor, QuantizedRows) else None


def _gather_values_from_peers(source: RowSource, schedule: Schedule) -> Tensor:
    """_gather_values over the ranks' FP8 regions in place: their bytes pulled as bf16 pairs."""
    rows = ops.dispatch_rows_from_peers(
        as_bf16_pairs(source.tensor.values), list(source.peer_ptrs), schedule.slot_to_route, schedule.topk,
        schedule.expert_offsets,
    )
    return from_bf16_pairs(rows)


def dispatch_rows(source: RowSource, schedule: Schedule):
    """-> (capacity, H): QuantizedRows (scales (capacity, H/128), row-wise) from an FP8 source, else
    the BF16 kernel's dispatch. Padding rows zero (FP8: zero bytes, scale 0). A symmetric FP8 source
    is pulled from the peers by the same kernels, bitwise the gathered one's rows."""
    rows_all = _fp8_source(source)
    if rows_all is None:
        return kernel.dispatch_rows(source, schedule)
    if source.peer_ptrs is not None:
        scales = ops.dispatch_rows_from_peers(
            rows_all.scales, list(source.scale_peer_ptrs), schedule.slot_to_route, schedule.topk, schedule.expert_offsets
        )
        return QuantizedRows(_gather_values_from_peers(source, schedule), scales)
    scales = ops.dispatch_rows(rows_all.scales, schedule.slot_to_route, schedule.topk, schedule.expert_offsets)
    return QuantizedRows(_gather_values(rows_all.values, schedule), scales)


def dispatch_gate_up(
    source: RowSource, schedule: Schedule, fc1: Tensor, ring_minibatches: int, *, recipe: Fp8Recipe
) -> tuple[None, Tensor, GemmOperand]:
    """-> (None, gate_up (capacity, 2F) bf16, act (capacity, F) as a GemmOperand). The FP8 rows are not
    returned: backward quantizes its weight gradients from the bf16 rows, and dropping them here frees
    them before the down projection runs. ring_minibatches (the BF16 dispatching GEMM's) does not apply."""
    weight = fp8_weights.quantized(fc1, recipe.pow2_scales, kernels=True, cache=recipe.cache_weights,
                                   keep_transposed=recipe.cache_transposed_weights)
    return _dispatch_gate_up(source, schedule, weight, recipe)


def _dispatch_gate_up(source: RowSource, schedule: Schedule, weight: fp8_weights.QuantizedWeight,
                      recipe: Fp8Recipe) -> tuple[None, Tensor, GemmOperand]:
    """dispatch_gate_up with fc1's FP8 copy given."""
    rows = dispatch_rows(source, schedule)
    offsets = schedule.expert_offsets
    rows_scales = gemm_a_layout(rows.scales)
    if _act_in_gemm_epilogue(recipe):
        gate_up, act, act_scales = ops.fp8_expert_gemm_swiglu(
            rows.values, rows_scales, weight.values, weight.scales, offsets, **_launch(),
            variant=tuning.FP8_EXPERT_GEMM_SWIGLU_VARIANT,
        )
        return None, gate_up, GemmOperand(act, act_scales)
    gate_up = _gemm(rows.values, rows_scales, weight, offsets)
    del rows, rows_scales
    return None, gate_up, GemmOperand(*ops.fp8_quantize_swiglu(gate_up, offsets, pow2=recipe.pow2_scales))


def _act_in_gemm_epilogue(recipe: Fp8Recipe) -> bool:
    """Whether dispatch_gate_up makes act in the gate/up GEMM's epilogue (tuning.FP8_ACT_QUANTIZE)."""
    if tuning.FP8_ACT_QUANTIZE not in tuning.FP8_ACT_QUANTIZE_CHOICES:
        raise ValueError(f"backends.tuning.FP8_ACT_QUANTIZE must be one of {tuning.FP8_ACT_QUANTIZE_CHOICES}, "
                         f"got {tuning.FP8_ACT_QUANTIZE!r}")
    return tuning.FP8_ACT_QUANTIZE == "gemm_epilogue" and not recipe.pow2_scales


def recompute_gate_up(source: RowSource, schedule: Schedule, fc1: Tensor, *, recipe: Fp8Recipe) -> Tensor:
    """dispatch_gate_up's gate_up (capacity, 2F) bf16 alone, bitwise (the same rows, weight bytes and
    GEMM): backward's windows after the first make act again only where they quantize it, from
    gate_up (ActColumns), so the act quantization launch is not run. fc1's copy is the cached one,
    else made range of experts by range for this GEMM, of the window's experts with rows alone
    (fp8_weights.forward_experts, _gemm_by_expert_ranges: the same bytes for every block the GEMM
    reads), so no more than a range's share of it exists at once and none is held across a backward's
    windows. Where act comes from the GEMM's epilogue (no launch of its own) this is dispatch_gate_up
    itself over a copy of the window's experts: the same kernel, so the same bits by construction."""
    offsets, experts = schedule.expert_offsets, fc1.shape[0]
    copy_of = functools.partial(fp8_weights.forward_experts, fc1, pow2=recipe.pow2_scales, cache=recipe.cache_weights)
    if _act_in_gemm_epilogue(recipe):
        return _dispatch_gate_up(source, schedule, copy_of(0, experts, expert_offsets=offsets), recipe)[1]
    rows = dispatch_rows(source, schedule)
    return _gemm_by_expert_ranges(rows.values, gemm_a_layout(rows.scales), offsets, experts, fc1.shape[1], copy_of)


def expert_down(act: GemmOperand, fc2: Tensor, offsets: Tensor, *, recipe: Fp8Recipe,
                push: Optional[PushTarget] = None) -> Optional[Tensor]:
    """act (capacity, F) FP8 -> (capacity, H) bf16; with push (expert_down_pushed) written there."""
    weight = fp8_weights.quantized(fc2, recipe.pow2_scales, kernels=True, cache=recipe.cache_weights,
                                   keep_transposed=recipe.cache_transposed_weights)
    return _gemm(act.values, act.scales, weight, offsets, push=push)


def expert_down_pushed(act: GemmOperand, fc2: Tensor, offsets: Tensor, target: PushTarget, *, recipe: Fp8Recipe) -> None:
    """expert_down's rows pushed by the GEMM's epilogue (ops.fp8_expert_gemm_push)."""
    expert_down(act, fc2, offsets, recipe=recipe, push=target)


def pull_route_grads(source: GradSource, schedule: Schedule):
    """w[route] * dY[route // K] per row: QuantizedRows (dY's E4M3 bytes, its scales times w) from an
    FP8 dY source, else the BF16 kernel's pull. Padding rows zero (FP8: zero bytes, scale 0)."""
    grad_y_all = _fp8_source(source.grad_y)
    if grad_y_all is None:
        return kernel.pull_route_grads(source, schedule)
    if source.grad_y.peer_ptrs is not None:
        scales = ops.pull_grad_rows_from_peers(
            grad_y_all.scales, list(source.grad_y.scale_peer_ptrs), list(source.weights.peer_ptrs),
            schedule.slot_to_route, schedule.topk, schedule.expert_offsets,
        )
        return QuantizedRows(_gather_values_from_peers(source.grad_y, schedule), scales)
    scales = ops.pull_grad_rows(
        grad_y_all.scales, source.weights.tensor, schedule.slot_to_route, schedule.topk, schedule.expert_offsets
    )
    return QuantizedRows(_gather_values(grad_y_all.values, schedule), scales)


class GradGateUp:
    """d gate_up (capacity, 2F) as the SwiGLU backward leaves it with FP8 weight gradients: both of its
    FP8 copies and no bf16 values. The row-wise one (1x128 along 2F, the gate/up dgrad's left
    operand) comes out of the SwiGLU backward's own pass (ops.fp8_quantize_swiglu_backward); the
    column-wise one (1x128 along the rows, the fc1 weight gradient's operand) is quantized from the
    bf16 values at once, which are then freed (with tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS both
    copies come out of that one pass, ops.fp8_quantize_swiglu_backward_copies, and no bf16 values
    exist), so that what stays alive through the fc2 weight
    gradient is two one-byte copies, the bytes of the bf16 d gate_up that was alive there before.
    The dgrad takes the row-wise copy (take_rows) and frees it: the fc1 weight gradient runs beside
    the column-wise copy alone. Both copies are bitwise what quantizing the bf16 d gate_up gives."""

    def __init__(self, rows: GemmOperand, columns: tuple[Tensor, Tensor], shape: tuple[int, int]):
        self._rows: Optional[GemmOperand] = rows  # (capacity, 2F) e4m3, scales (2F/128, fp8_scale_rows(capacity))
        self.columns = columns  # q (2F, capacity_pad) e4m3, scales (capacity_pad/128, 2F) fp32
        self.shape = shape  # (capacity, 2F)

    def take_rows(self) -> GemmOperand:
        """The row-wise copy, handed over once: this object keeps no reference to it."""
        if self._rows is None:
            raise RuntimeError("GradGateUp.take_rows: the row-wise copy was already taken (one dgrad per d gate_up)")
        rows, self._rows = self._rows, None
        return rows


def dgrad_swiglu(grad_out: QuantizedRows, fc2: Tensor, gate_up: Tensor, offsets: Tensor, *, recipe: Fp8Recipe):
    """grad_out (capacity, H) FP8 -> d gate_up (capacity, 2F): d act = FP8 GEMM with fc2 transposed
    (E, F, H), rounded to bf16, then the SwiGLU backward (fp32, rounded once), as the reference. With
    FP8 weight gradients a GradGateUp (both copies are made even where no weight gradient, or no input
    gradient, is wanted: the stage cannot tell; an untaken copy lives as long as the GradGateUp);
    with BF16 ones the bf16 tensor, which the BF16 weight gradient reads as it is."""
    if recipe.weight_grad and tuning.FP8_SWIGLU_BACKWARD_IN_DGRAD:
        values, rows, rows_scales = _dgrad_with_swiglu_backward(grad_out, fc2, kernel_ready(gate_up), offsets,
                                                                recipe=recipe)
    else:
        grad_act = _dgrad(grad_out.values, gemm_a_layout(grad_out.scales), fc2, offsets, recipe=recipe)
        if not recipe.weight_grad:
            return ops.swiglu_backward(gate_up, grad_act, offsets)
        if tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS:  # both copies from one pass, no bf16 d gate_up
            return _copies_in_one_pass(gate_up, grad_act, offsets, recipe=recipe, act_columns=False)[0]
        values, rows, rows_scales = ops.fp8_quantize_swiglu_backward(
            kernel_ready(gate_up), grad_act, offsets, pow2=recipe.pow2_scales
        )
        del grad_act
    columns = quantize_columns(values, offsets, recipe.pow2_scales)
    return GradGateUp(GemmOperand(rows, rows_scales), columns, tuple(values.shape))


def act_columns_in_one_pass() -> bool:
    """Whether backward makes act's column copy in the SwiGLU backward's one pass: tuning's
    FP8_ACT_COLUMNS_IN_ONE_PASS with FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS, the SwiGLU backward outside
    the dgrad. Part of the stage table's key (kernel_fp8_stages)."""
    return (tuning.FP8_ACT_COLUMNS_IN_ONE_PASS and tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS
            and not tuning.FP8_SWIGLU_BACKWARD_IN_DGRAD)


def dgrad_swiglu_and_act(grad_out: QuantizedRows, fc2: Tensor, gate_up: Tensor, offsets: Tensor, *,
                         recipe: Fp8Recipe) -> tuple["GradGateUp", "ActColumns"]:
    """dgrad_swiglu and weight_grad_act of one window (FP8 weight gradients, act_columns_in_one_pass):
    after the down dgrad one launch makes d gate_up's two copies and act's column copy, reading gate_up
    once (ops.fp8_quantize_swiglu_backward_copies with act_columns): the bytes of dgrad_swiglu's one
    pass and of weight_grad_act."""
    grad_act = _dgrad(grad_out.values, gemm_a_layout(grad_out.scales), fc2, offsets, recipe=recipe)
    return _copies_in_one_pass(gate_up, grad_act, offsets, recipe=recipe, act_columns=True)


def _copies_in_one_pass(gate_up: Tensor, grad_act: Tensor, offsets: Tensor, *, recipe: Fp8Recipe,
                        act_columns: bool) -> tuple["GradGateUp", Optional["ActColumns"]]:
    """The SwiGLU backward's one pass (ops.fp8_quantize_swiglu_backward_copies) -> (GradGateUp: d
    gate_up's two copies, no bf16 values; with act_columns act's ActColumns from the same gate_up, else
    None)."""
    rows, rows_scales, columns_q, columns_scales, act_q, act_scales = ops.fp8_quantize_swiglu_backward_copies(
        kernel_ready(gate_up), grad_act, offsets, pow2=recipe.pow2_scales, act_columns=act_columns
    )
    shape = tuple(gate_up.shape)
    grad_gate_up = GradGateUp(GemmOperand(rows, rows_scales), (columns_q, columns_scales), shape)
    return grad_gate_up, ActColumns((act_q, act_scales), (shape[0], shape[1] // 2)) if act_columns else None


def _dgrad_with_swiglu_backward(grad_out: QuantizedRows, fc2: Tensor, gate_up: Tensor, offsets: Tensor, *,
                                recipe: Fp8Recipe) -> tuple[Tensor, Tensor, Tensor]:
    """The down dgrad with the SwiGLU backward and d gate_up's row-wise quantization in its epilogue
    (ops.fp8_expert_gemm_swiglu_backward), range of experts by range as _dgrad's (each range's
    transposed copy made, multiplied into the one output, freed) -> (d gate_up (capacity, 2F) bf16,
    its e4m3 rows, their GEMM-A scales): fp8_quantize_swiglu_backward's outputs of _dgrad's d act, bit
    for bit on the segments' rows, with no d act in memory. With a kept transposed copy
    (_kept_transposed) one launch over it."""
    copy_of = functools.partial(fp8_weights.transposed_experts, fc2, pow2=recipe.pow2_scales,
                                cache=recipe.cache_weights)
    values, scales = grad_out.values, gemm_a_layout(grad_out.scales)
    num_experts = fc2.shape[0]
    span = tuning.fp8_dgrad_expert_span(num_experts)
    kept = _kept_transposed(fc2, recipe)
    if kept is not None:  # the whole kept copy in one launch
        copy_of, span = (lambda first, end, expert_offsets: kept), num_experts
    out = None
    for first in range(0, num_experts, span):
        end = min(num_experts, first + span)
        range_offsets = offsets[first:end + 1]
        copy = copy_of(first, end, expert_offsets=range_offsets)
        out = ops.fp8_expert_gemm_swiglu_backward(
            values, scales, copy.values, copy.scales, range_offsets, **_launch(), gate_up=gate_up,
            pow2=recipe.pow2_scales, variant=tuning.FP8_SWIGLU_BACKWARD_GEMM_VARIANT, out=out,
        )
        del copy  # (before the next range's copy is made)
    return out


def dgrad_rows(grad_gate_up, fc1: Tensor, offsets: Tensor, *, recipe: Fp8Recipe,
               push: Optional[PushTarget] = None) -> Optional[Tensor]:
    """d gate_up (capacity, 2F), a GradGateUp (its row-wise copy taken) or bf16 (then quantized 1x128
    along 2F here) -> d rows (capacity, H) bf16; with push (dgrad_rows_pushed) written there."""
    if isinstance(grad_gate_up, GradGateUp):
        operand = grad_gate_up.take_rows()
        values, scales = operand.values, operand.scales
    else:
        values, scales = quantize_rows_gemm_a(grad_gate_up, recipe.pow2_scales)
    return _dgrad(values, scales, fc1, offsets, recipe=recipe, push=push)


def dgrad_rows_pushed(grad_gate_up, fc1: Tensor, offsets: Tensor, target: PushTarget, *, recipe: Fp8Recipe) -> None:
    """dgrad_rows' d rows pushed by the GEMMs' epilogues (ops.fp8_expert_gemm_push)."""
    dgrad_rows(grad_gate_up, fc1, offsets, recipe=recipe, push=target)


@dataclasses.dataclass(frozen=True)
class RowsToGather:
    """A window's dispatched rows not gathered: row r is row row_index[r] of the group's rows, a zero
    row for -1 (the dispatch kernel's rows, bit for bit), times row_weights[r] where given (the
    weighted pull's w * dY, bit for bit). A weight gradient quantizes them column-wise straight from
    where they lie (ops.fp8_quantize_columns row_index, row_weights; over the ranks' symmetric regions
    ops.fp8_quantize_columns_from_peers), so no (capacity, H) bf16 copy is made."""

    source: Tensor  # (R * T, H) bf16: the exchange's stacked rows (x, or dY); with peer_ptrs this rank's (T, H) region
    row_index: Tensor  # (capacity,) int64: rows of the group, g = rank g // T's token g % T
    row_weights: Optional[Tensor] = None  # (capacity,) float32: each row's route weight
    peer_ptrs: Optional[tuple[int, ...]] = None  # every rank's address of source's region, rank order

    @property
    def shape(self) -> tuple[int, int]:
        return (self.row_index.shape[0], self.source.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype


def _token_of_each_row(schedule: Schedule) -> Tensor:
    """(capacity,) int64: each row's token in the stacked rows (route // K), -1 for a padding row."""
    route = schedule.slot_to_route
    return torch.where(route >= 0, route // schedule.topk, route)


def weight_grad_rows(source: RowSource, schedule: Schedule):
    """The fc1 weight gradient's rows: RowsToGather from a bf16 source in one tensor, or in the
    ranks' symmetric regions (tuning.FP8_WGRAD_COLUMNS_FROM_PEERS); otherwise (over the regions
    without it, or from FP8 rows) dispatch_rows' gathered rows."""
    if _fp8_source(source) is not None or (source.peer_ptrs is not None and not tuning.FP8_WGRAD_COLUMNS_FROM_PEERS):
        return dispatch_rows(source, schedule)
    return RowsToGather(source.tensor, _token_of_each_row(schedule), peer_ptrs=source.peer_ptrs)


def weight_grad_route_grads(source: GradSource, schedule: Schedule):
    """The fc2 weight gradient's w * dY rows: RowsToGather with each row's route weight from a bf16 dY
    in one tensor, or in the ranks' symmetric regions (tuning.FP8_WGRAD_COLUMNS_FROM_PEERS; the
    routes' weights, R * T * K fp32, copied from the regions first), quantized column-wise straight
    from dY: no pulled (capacity, H) bf16 rows; over the regions without it, pull_route_grads'
    pulled rows."""
    grad_y, weights = source.grad_y, source.weights
    if _fp8_source(grad_y) is not None:
        raise ValueError("the fc2 weight gradient quantizes w * dY from dY in the activation dtype, got FP8 dY rows")
    if grad_y.peer_ptrs is not None and not tuning.FP8_WGRAD_COLUMNS_FROM_PEERS:
        return kernel.pull_route_grads(source, schedule)
    if weights.peer_ptrs is not None:  # (then dY's too: a GradSource holds both in one form)
        flat = ops.gather_peer_regions(weights.tensor, list(weights.peer_ptrs)).reshape(-1).float()
    else:
        flat = weights.tensor.reshape(-1).float()
    route = schedule.slot_to_route
    # A padding row's weight is never read (its row index is -1); without tokens every row is one. A
    # route past the routes (a malformed schedule) is clamped here and then trapped, with its failure
    # record, by the column kernel's row index check (its token is past the rows).
    row_weights = flat.index_select(0, route.clamp(0, flat.numel() - 1)) if flat.numel() else flat.new_zeros(route.shape)
    return RowsToGather(grad_y.tensor, _token_of_each_row(schedule), row_weights, grad_y.peer_ptrs)


@dataclasses.dataclass(frozen=True)
class ActColumns:
    """A window's act for the fc2 weight gradient, never made in bf16: SwiGLU of gate_up (the SwiGLU
    kernel's bits) quantized 1x128 along the rows straight from gate_up
    (ops.fp8_quantize_swiglu_columns) as soon as the SwiGLU backward has read gate_up, so that gate_up
    is freed before the weight gradient's other operand is pulled."""

    columns: tuple[Tensor, Tensor]  # the column-wise FP8 values and scales of quantize_columns
    shape: tuple[int, int]  # (capacity, F): the act it stands for


def weight_grad_act(gate_up: Tensor, offsets: Tensor, *, recipe: Fp8Recipe) -> ActColumns:
    """gate_up (capacity, 2F) bf16 -> the fc2 weight gradient's act operand, ActColumns (offsets: the
    window's, along which its columns are quantized)."""
    columns = ops.fp8_quantize_swiglu_columns(kernel_ready(gate_up), offsets, pow2=recipe.pow2_scales)
    return ActColumns(columns, (gate_up.shape[0], gate_up.shape[1] // 2))


def _quantize_columns(rows, offsets: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    if isinstance(rows, RowsToGather) and rows.peer_ptrs is not None:
        return quantize_columns_from_peers(rows.source, rows.peer_ptrs, offsets, pow2, rows.row_index, rows.row_weights)
    if isinstance(rows, RowsToGather):
        return quantize_columns(rows.source, offsets, pow2, row_index=rows.row_index, row_weights=rows.row_weights)
    return quantize_columns(rows, offsets, pow2)


@dataclasses.dataclass(frozen=True)
class WindowedWeightGrad:
    """What a windowed FP8 weight gradient hands from one receive window to the next: the bf16
    result, filled expert by expert as their chains end, and the two fp32 carries the windows use in
    turn (ops.fp8_expert_wgrad `carry`: the one expert crossing a window's end goes on in one)."""

    rounded: Tensor  # (E, m, n) bf16
    carries: tuple[Tensor, Tensor]  # (m, n) float32 each


def weight_grad_window(grad_out, inputs, window, carried: Optional[WindowedWeightGrad], *, recipe: Fp8Recipe):
    """grad_out (W, m) bf16, RowsToGather (w * dY) or a GradGateUp (its column-wise copy), inputs (W, n) bf16, RowsToGather or
    ActColumns: a receive window's rows (receive.Window) -> both quantized 1x128 along the rows, their
    FP8 weight gradients added to the experts' chains. Returns what the next window carries
    (WindowedWeightGrad) after a window that is not the last, the (E, m, n) bf16 gradient after the
    last.

    One window (every pass over the collective exchange): one launch writing the bf16 gradient
    directly (ops.fp8_expert_wgrad `rounded`: each fp32 sum rounded once in the kernel), so no fp32
    copy of the gradient exists. Several windows: the kernel's windowed form, each expert's chain
    rounded into the result by the window that ends it and carried between windows only across a
    window edge, so the fp32 state is two (m, n) carries (not an (E, m, n) total), no window touches
    an expert it has no rows of, and the result is bitwise one pass over every row."""
    offsets = window.schedule.expert_offsets
    if isinstance(grad_out, GradGateUp):
        grad, grad_scales = grad_out.columns
    else:
        grad, grad_scales = _quantize_columns(grad_out, offsets, recipe.pow2_scales)
    if isinstance(inputs, ActColumns):
        values, value_scales = inputs.columns
    else:
        values, value_scales = _quantize_columns(inputs, offsets, recipe.pow2_scales)
    operands = (grad, grad_scales, values, value_scales, window.full_offsets)
    num_experts, m, n = window.full_offsets.shape[0] - 1, grad_out.shape[1], inputs.shape[1]
    # The result in the activation dtype (a GradGateUp's d gate_up was bf16, the kernel backend's).
    result = dict(dtype=torch.bfloat16 if isinstance(grad_out, GradGateUp) else grad_out.dtype, device=grad.device)
    if window.num_windows == 1:
        rounded = torch.empty((num_experts, m, n), **result)
        return ops.fp8_expert_wgrad(*operands, rounded=rounded, variant=tuning.FP8_WGRAD_VARIANT)
    if carried is None:
        carries = tuple(torch.empty((m, n), dtype=torch.float32, device=grad.device) for _ in range(2))
        carried = WindowedWeightGrad(torch.empty((num_experts, m, n), **result), carries)
    carry = (carried.carries[window.index % 2], carried.carries[(window.index + 1) % 2])
    ops.fp8_expert_wgrad(*operands, window_begin=window.begin, rounded=carried.rounded, carry=carry,
                         variant=tuning.FP8_WGRAD_VARIANT)
    return carried.rounded if window.last else carried


def _swiglu(gate_up: Tensor, offsets: Tensor) -> Tensor:
    return ops.swiglu_forward(gate_up, offsets)


def _swiglu_backward(gate_up: Tensor, grad_act: Tensor, offsets: Tensor) -> Tensor:
    return ops.swiglu_backward(gate_up, grad_act, offsets)


def kernel_fp8_stages(recipe: Fp8Recipe, expert_gemm: str = "auto") -> Stages:
    """The kernel backend's stage table for one FP8 recipe; expert_gemm (MoKConfig.expert_gemm) picks
    the BF16 weight gradients' family when recipe.weight_grad is False. The tuning settings that pick
    stages of the table (not a launch inside one) are part of its key, so a setting changed between
    calls takes effect at the next one (the benchmarks change them in one process)."""
    return _kernel_fp8_stages(recipe, expert_gemm, tuning.FP8_PUSH_IN_EPILOGUE, act_columns_in_one_pass())


@functools.cache
def _kernel_fp8_stages(recipe: Fp8Recipe, expert_gemm: str, push_in_epilogue: bool, act_in_one_pass: bool) -> Stages:
    if expert_gemm not in kernel.KERNEL_STAGES:
        raise ValueError(f"unknown expert_gemm {expert_gemm!r}, expected one of {tuple(kernel.KERNEL_STAGES)}")
    bf16 = kernel.KERNEL_STAGES[expert_gemm]
    bind = lambda stage: functools.partial(stage, recipe=recipe)  # noqa: E731
    if recipe.weight_grad:
        weight_grads = dict(
            segment_weight_grad=bf16.segment_weight_grad, weight_grad_family="fp8_kernel",
            weight_grad_window=bind(weight_grad_window),
        )
    else:
        weight_grads = dict(segment_weight_grad=bf16.segment_weight_grad, weight_grad_family=EXPERT_GEMM_CHOICES[expert_gemm].weight_grads)
    return Stages(
        dispatch_rows=dispatch_rows,
        dispatch_gate_up=bind(dispatch_gate_up),
        recompute_gate_up=bind(recompute_gate_up),
        expert_down=bind(expert_down),
        segment_matmul=bf16.segment_matmul,
        swiglu=_swiglu,
        swiglu_backward=_swiglu_backward,
        dgrad_swiglu=bind(dgrad_swiglu),
        dgrad_rows=bind(dgrad_rows),
        expert_down_pushed=bind(expert_down_pushed) if push_in_epilogue else None,
        dgrad_rows_pushed=bind(dgrad_rows_pushed) if push_in_epilogue else None,
        combine=bf16.combine,
        pull_route_grads=pull_route_grads,
        route_weight_grads=bf16.route_weight_grads,
        quantize_rows=quantize_source_rows,
        weight_grad_rows=weight_grad_rows if recipe.weight_grad else None,
        weight_grad_act=bind(weight_grad_act) if recipe.weight_grad else None,
        dgrad_swiglu_and_act=bind(dgrad_swiglu_and_act) if recipe.weight_grad and act_in_one_pass else None,
        weight_grad_route_grads=weight_grad_route_grads if recipe.weight_grad else None,
        **weight_grads,
    )
