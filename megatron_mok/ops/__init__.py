"""The `megatron_mok` custom ops over the CUDA extension: one module per op family, each op's fake
implementation beside its wrapper; the extension's loading and self-report in `extension.py`.

    schedule.py          build_schedule
    dispatch_combine.py  dispatch_rows, combine, combine_keeping, pull_grad_rows, route_weight_grads,
                         dispatch_rows_from_peers, pull_grad_rows_from_peers
    swiglu.py            swiglu_forward, swiglu_backward
    expert_gemm.py       expert_gemm, expert_gemm_swiglu, dispatch_expert_gemm_swiglu,
                         dispatch_expert_gemm_swiglu_from_peers (the same kernel, rows from the peers),
                         expert_gemm_dgrad, expert_gemm_dgrad_swiglu, expert_gemm_wgrad,
                         expert_gemm_wgrad_window (and wgrad_carry_numel, its carries' size)
    fp8_gemm.py          fp8_expert_gemm (FP8 blockwise, fprop and dgrad), fp8_expert_gemm_push (the same,
                         its rows pushed into the sources' combine regions), fp8_expert_gemm_swiglu (gate/up
                         with SwiGLU, act quantized 1x128), fp8_expert_gemm_swiglu_backward (the down
                         dgrad with the SwiGLU backward and d gate_up's 1x128 quantization); their
                         references beside them
    fp8_wgrad.py         fp8_expert_wgrad (FP8 blockwise weight gradients, column-wise operands, fp32 out
                         accumulated across receive windows); its reference beside it
    fp8_quant.py         fp8_quantize_rows (1x128 along C, optional gather), fp8_quantize_swiglu (SwiGLU
                         of gate/up quantized 1x128 along F), fp8_quantize_columns (1x128 along tokens,
                         transposed; fp8_quantize_columns_from_peers: gathered from the ranks'
                         regions), fp8_quantize_swiglu_columns (SwiGLU of gate/up quantized 1x128
                         along tokens), fp8_quantize_swiglu_backward (the SwiGLU backward with d
                         gate_up's row-wise quantization; fp8_quantize_swiglu_backward_copies: with
                         both of its FP8 copies and no bf16 values), fp8_quantize_weight (128x128
                         and its transposed copy),
                         fp8_transpose_weight (the transposed copy from the 128x128 one); their
                         references beside them
    tensor_checks.py     overlap (whether two tensors share bytes: the wrappers' aliasing checks)
    exchange.py          exchange_phase_names, exchange_begin, exchange_signal, exchange_wait_ready,
                         push_rows, gather_peer_regions (the in-kernel exchange, comm/symmetric.py)

Each op's PyTorch reference is the function of the same stage in backends/reference.py (the FP8
ops': the `*_reference` beside them, over megatron_mok/quantization.py).
"""

from megatron_mok.ops.dispatch_combine import (
    combine,
    combine_keeping,
    dispatch_rows,
    dispatch_rows_from_peers,
    pull_grad_rows,
    pull_grad_rows_from_peers,
    route_weight_grads,
)
from megatron_mok.ops.exchange import (
    exchange_begin,
    exchange_phase_names,
    exchange_signal,
    exchange_wait_ready,
    gather_peer_regions,
    push_rows,
)
from megatron_mok.ops.expert_gemm import (
    dispatch_expert_gemm_swiglu,
    dispatch_expert_gemm_swiglu_from_peers,
    expert_gemm,
    expert_gemm_dgrad,
    expert_gemm_dgrad_swiglu,
    expert_gemm_swiglu,
    expert_gemm_wgrad,
    expert_gemm_wgrad_window,
    wgrad_carry_numel,
)
from megatron_mok.ops.extension import compiled_limits, extension_error, last_failure
from megatron_mok.ops.fp8_gemm import (
    fp8_expert_gemm,
    fp8_expert_gemm_push,
    fp8_expert_gemm_reference,
    fp8_expert_gemm_swiglu,
    fp8_expert_gemm_swiglu_backward,
    fp8_expert_gemm_swiglu_backward_reference,
    fp8_expert_gemm_swiglu_reference,
)
from megatron_mok.ops.fp8_wgrad import fp8_expert_wgrad, fp8_expert_wgrad_reference
from megatron_mok.ops.fp8_quant import (
    fp8_quantize_columns,
    fp8_quantize_columns_from_peers,
    fp8_quantize_columns_reference,
    fp8_quantize_rows,
    fp8_quantize_rows_reference,
    fp8_quantize_swiglu,
    fp8_quantize_swiglu_columns,
    fp8_quantize_swiglu_columns_reference,
    fp8_quantize_swiglu_backward,
    fp8_quantize_swiglu_backward_copies,
    fp8_quantize_swiglu_backward_copies_reference,
    fp8_quantize_swiglu_backward_reference,
    fp8_quantize_grad_gate_up_reference,
    fp8_quantize_swiglu_reference,
    fp8_quantize_weight,
    fp8_quantize_weight_reference,
    fp8_transpose_weight,
    fp8_transpose_weight_reference,
)
from megatron_mok.ops.schedule import build_schedule
from megatron_mok.ops.swiglu import swiglu_backward, swiglu_forward

__all__ = [
    "build_schedule",
    "combine",
    "combine_keeping",
    "compiled_limits",
    "dispatch_expert_gemm_swiglu",
    "dispatch_expert_gemm_swiglu_from_peers",
    "dispatch_rows",
    "dispatch_rows_from_peers",
    "exchange_begin",
    "exchange_phase_names",
    "exchange_signal",
    "exchange_wait_ready",
    "expert_gemm",
    "expert_gemm_dgrad",
    "expert_gemm_dgrad_swiglu",
    "expert_gemm_swiglu",
    "expert_gemm_wgrad",
    "expert_gemm_wgrad_window",
    "extension_error",
    "fp8_expert_gemm",
    "fp8_expert_gemm_push",
    "fp8_expert_gemm_reference",
    "fp8_expert_gemm_swiglu",
    "fp8_expert_gemm_swiglu_backward",
    "fp8_expert_gemm_swiglu_backward_reference",
    "fp8_expert_gemm_swiglu_reference",
    "fp8_expert_wgrad",
    "fp8_expert_wgrad_reference",
    "fp8_quantize_columns",
    "fp8_quantize_columns_from_peers",
    "fp8_quantize_columns_reference",
    "fp8_quantize_rows",
    "fp8_quantize_rows_reference",
    "fp8_quantize_swiglu",
    "fp8_quantize_swiglu_columns",
    "fp8_quantize_swiglu_columns_reference",
    "fp8_quantize_swiglu_backward",
    "fp8_quantize_swiglu_backward_copies",
    "fp8_quantize_swiglu_backward_copies_reference",
    "fp8_quantize_swiglu_backward_reference",
    "fp8_quantize_grad_gate_up_reference",
    "fp8_quantize_swiglu_reference",
    "fp8_quantize_weight",
    "fp8_quantize_weight_reference",
    "fp8_transpose_weight",
    "fp8_transpose_weight_reference",
    "gather_peer_regions",
    "last_failure",
    "pull_grad_rows",
    "pull_grad_rows_from_peers",
    "push_rows",
    "route_weight_grads",
    "swiglu_backward",
    "swiglu_forward",
    "wgrad_carry_numel",
]
