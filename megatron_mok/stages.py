"""The stages of a MoK pass, as one table per backend.

`functional` runs the same sequence of stages whichever backend is chosen; a backend supplies
each stage. The reference supplies all of them from `reference.py`; the kernel backend replaces
the memory-bound stages with CUDA kernels (`kernels.py`). Stage signatures:

    dispatch_rows(x_all, schedule) -> rows (capacity, H)
    dispatch_gate_up(x_all, schedule, fc1 (E, 2F, H), ring_minibatches) -> (rows (capacity, H) or None,
        gate_up (capacity, 2F), act (capacity, F)); None when the rows went through a ring buffer
        of ring_minibatches minibatches (MoKConfig.dispatch_ring_minibatches) and backward must
        gather them again
    expert_down(act, fc2 (E, H, F), offsets) -> (capacity, H)
    segment_matmul(rows, weight (E, N, K) any strides, offsets) -> (capacity, N)
    swiglu(gate_up, offsets) -> act (capacity, F)
    swiglu_backward(gate_up, grad_act, offsets) -> grad_gate_up (capacity, 2F)
    segment_weight_grad(grad_out, inputs, offsets) -> (E, N, K)
    dgrad_swiglu(grad_out, fc2 (E, H, F), gate_up, offsets) -> grad_gate_up (capacity, 2F)
    dgrad_rows(grad_gate_up, fc1 (E, 2F, H), offsets) -> grad_rows (capacity, H)
    combine(table, index, topk_weights | None, topk, dtype) -> (T, H) in dtype
    pull_route_grads(grad_y, topk_weights, schedule, workspace) -> (capacity, H)
    route_weight_grads(grad_y, table, index, topk) -> (T, K) float32

The forward's two expert projections are their own stages (dispatch_gate_up: the pull dispatch and
the gate/up projection with SwiGLU fused; expert_down) so the kernel backend runs them in its
persistent sm90 GEMM, which dispatches the rows itself, overlapped with the GEMM; segment_matmul serves
the backward's products with transposed weights. Rows at or past offsets[-1] may hold anything
after a matmul stage of the kernel backend; no stage reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_mok import reference


@dataclasses.dataclass(frozen=True)
class Stages:
    dispatch_rows: Callable
    dispatch_gate_up: Callable
    expert_down: Callable
    segment_matmul: Callable
    swiglu: Callable
    swiglu_backward: Callable
    segment_weight_grad: Callable
    dgrad_swiglu: Callable
    dgrad_rows: Callable
    combine: Callable
    pull_route_grads: Callable
    route_weight_grads: Callable


REFERENCE_STAGES = Stages(
    dispatch_rows=reference.dispatch_rows_reference,
    dispatch_gate_up=reference.dispatch_gate_up_reference,
    expert_down=reference.segment_matmul_reference,
    segment_matmul=reference.segment_matmul_reference,
    swiglu=reference.swiglu_reference,
    swiglu_backward=reference.swiglu_backward_reference,
    segment_weight_grad=reference.segment_weight_grad_reference,
    dgrad_swiglu=reference.dgrad_swiglu_reference,
    dgrad_rows=reference.dgrad_rows_reference,
    combine=reference.combine_reference,
    pull_route_grads=reference.pull_route_grads_reference,
    route_weight_grads=reference.route_weight_grads_reference,
)


def stages_for(backend: str, expert_gemm: str = "auto") -> Stages:
    """The stage table of a backend; expert_gemm (MoKConfig.expert_gemm) picks the kernel
    backend's expert GEMMs."""
    if backend == "reference":
        return REFERENCE_STAGES
    if backend == "kernel":
        from megatron_mok.kernels import KERNEL_STAGES

        if expert_gemm not in KERNEL_STAGES:
            raise ValueError(f"unknown expert_gemm {expert_gemm!r}, expected one of {tuple(KERNEL_STAGES)}")
        return KERNEL_STAGES[expert_gemm]
    raise ValueError(f"unknown backend {backend!r}")
