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
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

import torch

from megatron_mok.comm.exchange import GradSource, RowSource
from megatron_mok.schedule import Schedule

Tensor = torch.Tensor


class DispatchRows(Protocol):
    def __call__(self, source: RowSource, schedule: Schedule) -> Tensor:
        """Exchange.dispatch_source's rows -> rows (capacity, H) in schedule order, zero padding rows."""
        ...


class DispatchGateUp(Protocol):
    def __call__(
        self, source: RowSource, schedule: Schedule, fc1: Tensor, ring_minibatches: int
    ) -> tuple[Optional[Tensor], Tensor, Tensor]:
        """-> (rows (capacity, H) or None, gate_up (capacity, 2F), act (capacity, F)). rows is None
        when they went through a bounded ring (MoKConfig.dispatch_ring_minibatches) and backward
        must gather them again."""
        ...


class SegmentMatmul(Protocol):
    def __call__(self, rows: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
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


class DgradSwiglu(Protocol):
    def __call__(self, grad_out: Tensor, fc2: Tensor, gate_up: Tensor, offsets: Tensor) -> Tensor:
        """grad_out (capacity, H), fc2 (E, H, F) -> grad_gate_up (capacity, 2F)."""
        ...


class DgradRows(Protocol):
    def __call__(self, grad_gate_up: Tensor, fc1: Tensor, offsets: Tensor) -> Tensor:
        """grad_gate_up (capacity, 2F), fc1 (E, 2F, H) -> grad_rows (capacity, H)."""
        ...


class Combine(Protocol):
    def __call__(self, table: Tensor, index: Tensor, topk_weights: Optional[Tensor], topk: int, dtype: torch.dtype) -> Tensor:
        """-> (T, H) in dtype: sum over k ascending of w[t, k] * table[index[t*K + k]] in fp32,
        index -1 skipped, weights None = ones."""
        ...


class PullRouteGrads(Protocol):
    def __call__(self, source: GradSource, schedule: Schedule) -> Tensor:
        """Exchange.grad_source's dY rows and weights -> (capacity, H): w[route] * dY[route // K]."""
        ...


class RouteWeightGrads(Protocol):
    def __call__(self, grad_y: Tensor, table: Tensor, index: Tensor, topk: int) -> Tensor:
        """-> (T, K) float32: <dY[t], table[index[t*K + k]]>, zero for a dropped route."""
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
    # Which GEMM family segment_weight_grad is ("sm90", "grouped_mm", "reference"): how a pass over
    # several receive windows sums its weight gradients (backends/weight_grads.py).
    weight_grad_family: str
