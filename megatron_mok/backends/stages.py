"""The stage contract: what every backend supplies, typed.

`functional` runs one sequence of stages whichever backend is chosen; a backend is a `Stages`
table (backends/reference.py: every stage in PyTorch; backends/kernel.py: CUDA kernels). What
crosses ranks is not a stage of a backend but the exchange (megatron_mok/comm/exchange.py): the
stages below see only this rank's rows and the exchange's gathered sources.

Shapes: capacity = the schedule's rows; H hidden; F ffn_hidden; E local experts; T tokens; K topk.
Rows at or past offsets[-1] may hold anything after a matmul or gather stage of the kernel backend;
no stage reads them.

The forward's two expert projections are their own stages (dispatch_gate_up: the pull dispatch and
the gate/up projection with SwiGLU fused; expert_down) so the kernel backend can run them in its
persistent sm90 GEMM, which dispatches the rows itself, overlapped with the GEMM.

FP8 blockwise (docs/design.md §12, backends/reference_fp8.py): the same stages, with FP8 operands
where the recipe has them: a source's rows, the rows dispatch_gate_up reads, its act and expert_down's
input, pull_route_grads' rows from an FP8 dY source and dgrad_swiglu's grad_out are QuantizedRows
(quantization.py), except that act, which goes from dispatch_gate_up to expert_down of the same
table only, is the kernel backend's GEMM operand (backends/kernel_fp8.py GemmOperand: scales in the
GEMM-A layout); fc1 and fc2 are passed as stored, and the stages take their cached FP8 copies
(fp8_weights.py). Every other tensor (gate_up, d gate_up, the pushed rows, the weight gradients'
operands) keeps the activation dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

import torch

from megatron_mok.comm.exchange import GradSource, PushTarget, RowSource
from megatron_mok.quantization import QuantizedRows
from megatron_mok.schedule import Schedule

Tensor = torch.Tensor
Rows = Tensor | QuantizedRows  # (capacity, C): in the activation dtype, or FP8 1x128 along C


class DispatchRows(Protocol):
    def __call__(self, source: RowSource, schedule: Schedule) -> Rows:
        """Exchange.dispatch_source's rows -> rows (capacity, H) in schedule order, zero padding rows
        (FP8 rows from an FP8 source)."""
        ...


class DispatchGateUp(Protocol):
    def __call__(
        self, source: RowSource, schedule: Schedule, fc1: Tensor, ring_minibatches: int
    ) -> tuple[Optional[Rows], Tensor, Rows]:
        """-> (rows (capacity, H) or None, gate_up (capacity, 2F), act (capacity, F)). rows is None
        when they went through a bounded ring (MoKConfig.dispatch_ring_minibatches) and backward
        must gather them again. FP8: rows and act are QuantizedRows (act 1x128 along F)."""
        ...


class SegmentMatmul(Protocol):
    def __call__(self, rows: Rows, weight: Tensor, offsets: Tensor) -> Tensor:
        """rows (capacity, K), weight (E, N, K) any strides, offsets (E + 1,) int32 -> (capacity, N)."""
        ...


class Swiglu(Protocol):
    def __call__(self, gate_up: Tensor, offsets: Tensor) -> Tensor:
        """gate_up (capacity, 2F) -> act (capacity, F)."""
        ...


class SwigluBackward(Protocol):
    def __call__(self, gate_up: Tensor, grad_act: Tensor, offsets: Tensor) -> Tensor:
        """-> grad_gate_up (capacity, 2F)."""
        ...


class SegmentWeightGrad(Protocol):
    def __call__(self, grad_out: Tensor, inputs: Tensor, offsets: Tensor) -> Tensor:
        """grad_out (capacity, N), inputs (capacity, K) -> (E, N, K); zeros for an empty expert."""
        ...


class WeightGradInto(Protocol):
    def __call__(self, grad_out: Tensor, inputs: Tensor, offsets: Tensor, total: Tensor) -> None:
        """grad_out (capacity, N), inputs (capacity, K): adds the segments' gradients into total
        (E + 1, N, K) float32 (row E: rows past the segments, dropped), in an order that makes a pass
        window by window bitwise one pass over every row (backends/weight_grads.py Fp32Carried)."""
        ...


class WeightGradWindow(Protocol):
    def __call__(self, grad_out: Tensor, inputs: Tensor, window, carried: Optional[Tensor]) -> Tensor:
        """grad_out (W, N), inputs (W, K): a receive window's rows (receive.Window) -> their weight
        gradients added to `carried` (None for the first window), returned as what the next window
        carries; after the last window (E, N, K) in grad_out's dtype, bitwise one pass over every row."""
        ...


class WeightGradAct(Protocol):
    def __call__(self, gate_up: Tensor, expert_offsets: Tensor) -> object:
        """gate_up (R, 2F) -> the fc2 weight gradient's act as its weight_grad_window takes it (a
        (R, F) tensor, or what to quantize it from)."""
        ...


class RecomputeGateUp(Protocol):
    def __call__(self, source: RowSource, schedule: Schedule, fc1: Tensor) -> Tensor:
        """-> gate_up (capacity, 2F), bitwise dispatch_gate_up's, without its act: backward's gate/up
        of a window after the first, whose act it makes again from gate_up where it needs it."""
        ...


class DgradSwiglu(Protocol):
    def __call__(self, grad_out: Rows, fc2: Tensor, gate_up: Tensor, offsets: Tensor) -> object:
        """grad_out (capacity, H), fc2 (E, H, F) -> grad_gate_up (capacity, 2F): a tensor, or what the
        backend's dgrad_rows and fc1 weight gradient take (the FP8 kernel backend's GradGateUp)."""
        ...


class DgradSwigluAndAct(Protocol):
    def __call__(self, grad_out: Rows, fc2: Tensor, gate_up: Tensor, offsets: Tensor) -> tuple[object, object]:
        """DgradSwiglu's grad_gate_up and the fc2 weight gradient's act (as weight_grad_act, else
        swiglu, gives it) of the same gate_up, from one call: for a backend that makes both in one
        pass over gate_up."""
        ...


class DgradRows(Protocol):
    def __call__(self, grad_gate_up: object, fc1: Tensor, offsets: Tensor) -> Tensor:
        """grad_gate_up (capacity, 2F) as dgrad_swiglu returned it, fc1 (E, 2F, H) -> grad_rows
        (capacity, H)."""
        ...


class SegmentMatmulPushed(Protocol):
    def __call__(self, rows: Rows, weight: Tensor, offsets: Tensor, target: PushTarget) -> None:
        """SegmentMatmul's (capacity, N) rows written where target says (ReturnedRows.push_target),
        never into this rank's memory: bitwise SegmentMatmul then ReturnedRows.push."""
        ...


class DgradRowsPushed(Protocol):
    def __call__(self, grad_gate_up: object, fc1: Tensor, offsets: Tensor, target: PushTarget) -> None:
        """DgradRows' grad_rows written where target says, as SegmentMatmulPushed."""
        ...


class Combine(Protocol):
    def __call__(self, table: Tensor, index: Tensor, topk_weights: Optional[Tensor], topk: int, dtype: torch.dtype,
                 keep: Optional[Tensor] = None) -> Tensor:
        """-> (T, H) in dtype: sum over k ascending of w[t, k] * table[index[t*K + k]] in fp32,
        index -1 skipped, weights None = ones. keep ((table rows or more, H), table's dtype): every
        table row a route reads is also copied to the same row of keep (the rows no route reads are
        the implementation's to copy or not): forward's copy of a table the exchange reuses."""
        ...


class PullRouteGrads(Protocol):
    def __call__(self, source: GradSource, schedule: Schedule) -> Rows:
        """Exchange.grad_source's dY rows and weights -> (capacity, H): w[route] * dY[route // K]
        (from an FP8 dY: its E4M3 rows with their scales times w)."""
        ...


class RouteWeightGrads(Protocol):
    def __call__(self, grad_y: Tensor, table: Tensor, index: Tensor, topk: int) -> Tensor:
        """-> (T, K) float32: <dY[t], table[index[t*K + k]]>, zero for a dropped route."""
        ...


class QuantizeRows(Protocol):
    def __call__(self, rows: Tensor, pow2: bool) -> QuantizedRows:
        """rows (T, H) -> their 1x128 quantization along H (the source layout): what a rank publishes
        of x and dY with FP8 (docs/design.md §12.4)."""
        ...


@dataclasses.dataclass(frozen=True)
class Stages:
    dispatch_rows: DispatchRows
    dispatch_gate_up: DispatchGateUp
    expert_down: SegmentMatmul
    segment_matmul: SegmentMatmul
    swiglu: Swiglu
    swiglu_backward: SwigluBackward
    segment_weight_grad: SegmentWeightGrad
    dgrad_swiglu: DgradSwiglu
    dgrad_rows: DgradRows
    combine: Combine
    pull_route_grads: PullRouteGrads
    route_weight_grads: RouteWeightGrads
    # Which GEMM family segment_weight_grad is ("sm90", "grouped_mm", "reference", "fp32_carried",
    # "fp8_kernel"):
    # how a pass over several receive windows sums its weight gradients (backends/weight_grads.py).
    weight_grad_family: str
    # The "fp32_carried" family's stage: the weight gradients added into one fp32 total.
    weight_grad_into: Optional[WeightGradInto] = None
    # The "fp8_kernel" family's stage: the weight gradients carried from window to window.
    weight_grad_window: Optional[WeightGradWindow] = None
    # FP8: the quantization of what a rank publishes (the reference's PyTorch unless a backend has a
    # kernel for it).
    quantize_rows: QuantizeRows = QuantizedRows.quantize
    # The rows the fc1 weight gradient reads (its `inputs`), from the exchange's source: None is
    # dispatch_rows. A backend whose weight_grad_window quantizes straight from the source (the FP8
    # kernel backend) gives what to gather instead of the gathered (capacity, H) rows.
    weight_grad_rows: Optional[DispatchRows] = None
    # The act the fc2 weight gradient reads (its `inputs`), from the window's gate_up: None is swiglu.
    # A backend whose weight_grad_window quantizes act straight from gate_up (the FP8 kernel backend)
    # gives what to quantize instead of the (capacity, F) act.
    weight_grad_act: Optional[WeightGradAct] = None
    # The w * dY rows the fc2 weight gradient reads (its `grad_out`), from the exchange's dY source:
    # None is pull_route_grads. A backend whose weight_grad_window quantizes straight from dY and the
    # route weights (the FP8 kernel backend) gives what to gather instead of the pulled rows.
    weight_grad_route_grads: Optional[PullRouteGrads] = None
    # d gate_up and the fc2 weight gradient's act from one call where backward needs both (weight
    # gradients, act not kept): None is dgrad_swiglu, then weight_grad_act (or swiglu).
    dgrad_swiglu_and_act: Optional[DgradSwigluAndAct] = None
    # Backward's gate/up of a window after the first (receive.py): None is dispatch_gate_up's gate_up
    # (its rows and act dropped). A backend whose act is a launch of its own gives the GEMM alone, so
    # that backward does not make an act it drops.
    recompute_gate_up: Optional[RecomputeGateUp] = None
    # expert_down and dgrad_rows writing their rows straight into the exchange's push target (a GEMM
    # epilogue that pushes): None, or where the exchange gives no target, the stage's rows are made
    # and ReturnedRows.push moves them.
    expert_down_pushed: Optional[SegmentMatmulPushed] = None
    dgrad_rows_pushed: Optional[DgradRowsPushed] = None
