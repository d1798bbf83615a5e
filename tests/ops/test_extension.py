"""Where a CUDA toolchain and a CUDA build of torch exist, the extension must have been built
(CI has nvcc but no GPU: a kernel that does not compile for sm_90a fails here). CI also sets
MEGATRON_MOK_REQUIRE_EXTENSION=1, so a machine that lost its toolchain fails instead of skipping the
compile checks."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import limits
from cuda_checks import NEEDS_TOOLCHAIN, TOOLCHAIN_PRESENT

OPS = (
    "build_schedule", "dispatch_rows", "combine", "combine_keeping", "pull_grad_rows", "route_weight_grads", "swiglu_forward",
    "swiglu_backward", "expert_gemm", "expert_gemm_swiglu", "dispatch_expert_gemm_swiglu",
    "dispatch_expert_gemm_swiglu_from_peers", "expert_gemm_dgrad", "expert_gemm_dgrad_swiglu", "expert_gemm_wgrad",
    "expert_gemm_wgrad_window", "dispatch_rows_from_peers", "pull_grad_rows_from_peers",
    "exchange_begin", "exchange_signal", "exchange_wait_ready", "push_rows", "gather_peer_regions", "fp8_expert_wgrad",
    "fp8_quantize_swiglu_backward", "fp8_expert_gemm_into", "fp8_quantize_columns_from_peers",
    "fp8_expert_gemm_swiglu_backward_into",
)


@NEEDS_TOOLCHAIN
def test_toolchain_is_present_where_required():
    assert TOOLCHAIN_PRESENT, "MEGATRON_MOK_REQUIRE_EXTENSION=1 but nvcc or a CUDA build of torch is missing"


@NEEDS_TOOLCHAIN
@pytest.mark.parametrize("name", OPS)
def test_cuda_extension_is_built_and_registers_a_cuda_kernel(name):
    from megatron_mok.ops import extension_error

    assert extension_error() is None, f"megatron_mok._C did not load: {extension_error()}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_mok::{name}", "CUDA"), name
    # The fake (meta) implementation beside the wrapper (megatron_mok/ops/): torch.compile needs it.
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_mok::{name}", "Meta"), name


@NEEDS_TOOLCHAIN
def test_extension_was_compiled_with_the_limits_python_uses():
    from megatron_mok.ops import compiled_limits, last_failure

    assert compiled_limits() == limits.COMPILED, "a stale build: rebuild the extension (pip install -e .)"
    assert last_failure() is None


@NEEDS_TOOLCHAIN
def test_exchange_phases_come_from_the_extension_in_the_order_the_pad_uses():
    """comm/symmetric_exchange.py names these phases; their index is the pad's first dimension."""
    from megatron_mok import ops

    assert ops.exchange_phase_names() == ("routing", "tokens", "grad_tokens", "combine", "fp8_tokens", "fp8_grad_tokens")


@NEEDS_TOOLCHAIN
def test_exchange_fakes_give_the_shapes_without_a_device():
    """The fake implementations on meta tensors (torch.compile traces with them): no kernel runs."""
    from megatron_mok import ops

    meta = torch.device("meta")
    own = torch.empty(9, 64, dtype=torch.bfloat16, device=meta)
    slot_to_route = torch.empty(40, dtype=torch.int64, device=meta)
    assert ops.dispatch_rows_from_peers(own, [16, 32], slot_to_route, 2).shape == (40, 64)
    assert ops.pull_grad_rows_from_peers(own, [16, 32], [16, 32], slot_to_route, 2).shape == (40, 64)
    ids = torch.empty(9, 2, dtype=torch.int64, device=meta)
    assert ops.gather_peer_regions(ids, [16, 32, 48]).shape == (3, 9, 2)
    calls = torch.empty(4, dtype=torch.int64, device=meta)
    signals = torch.empty(4, 2, 2, dtype=torch.int64, device=meta)
    ops.exchange_begin(calls, signals, 0, 1)
    ops.exchange_signal(calls, signals, [16, 32], 0, 1, 0)
    ops.exchange_wait_ready(calls, signals, 0, 1)
    ops.push_rows(own.new_empty(40, 64), slot_to_route, 2, 9, own.new_empty(18, 64), [16, 32])


@NEEDS_TOOLCHAIN
def test_columns_from_peers_fake_gives_the_shapes_without_a_device():
    """The column quantization over the ranks' regions on meta tensors: (C, R_pad) e4m3 and
    (R_pad / 128, C) fp32 for R rows of the group, whatever the regions hold."""
    meta = torch.device("meta")
    own = torch.empty(9, 256, dtype=torch.bfloat16, device=meta)
    row_index = torch.empty(130, dtype=torch.int64, device=meta)
    q, scales = torch.ops.megatron_mok.fp8_quantize_columns_from_peers(own, [16, 32], None, False, row_index, None)
    assert q.shape == (256, 256) and q.dtype == torch.float8_e4m3fn
    assert scales.shape == (2, 256) and scales.dtype == torch.float32


@NEEDS_TOOLCHAIN
def test_wgrad_window_fake_writes_in_place_without_a_device():
    """The windowed weight gradient's fake on meta tensors: no result, out and carry_out mutated."""
    meta = torch.device("meta")
    m, n = 64, 256
    grad = torch.empty(128, m, dtype=torch.bfloat16, device=meta)
    inputs = torch.empty(128, n, dtype=torch.bfloat16, device=meta)
    offsets = torch.empty(4, dtype=torch.int32, device=meta)
    out = torch.empty(3, m, n, dtype=torch.bfloat16, device=meta)
    carries = [torch.empty(limits.wgrad_carry_numel(m, n), device=meta) for _ in range(2)]
    assert torch.ops.megatron_mok.expert_gemm_wgrad_window(grad, inputs, offsets, 128, False, out, *carries) is None
    schema = torch.ops.megatron_mok.expert_gemm_wgrad_window.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"out", "carry_out"}


def test_kernel_backend_is_not_chosen_for_cpu_tensors():
    from megatron_mok.backends import kernel_unsupported_reason

    reason = kernel_unsupported_reason(torch.zeros(2, 8), torch.zeros(1, 16, 8))
    assert reason is not None and "CUDA" in reason


@NEEDS_TOOLCHAIN
def test_expert_gemm_compiles_without_wgmma_serialization_spills_or_ignored_setmaxnreg(tmp_path):
    """ptxas's verdict on every expert-GEMM kernel the bindings instantiate (the translation unit
    csrc/bindings/expert_gemm_ops.cu, compiled as setup.py does): a function call in a kernel
    serializes every wgmma (C7510), a register shortfall drops setmaxnreg (C7507), a divergent path
    serializes wgmma (C7518), as does a non-wgmma write of accumulators inside a wgmma pipeline
    stage (C7515, e.g. a branch around the windowed weight gradient's carry load) -- silent
    performance losses the build log must not show. Spills (nvcc
    13.0): none in the K-major store kernels and the weight gradient, a few bytes in the MN-major and
    SwiGLU epilogues, most in the dispatching kernels (the dispatch warps live on the producer's 40
    registers; 56 bytes from one tensor, and as many from the peers' regions, whose rank lookup runs
    in 32 bits for that): allowed up to 16 (store), 32 (SwiGLU, SwiGLU backward), 64 (dispatching,
    both forms), 0 (weight gradients, whole and windowed), so a larger spill fails here."""
    from cuda_checks import ptxas_report

    log, found = ptxas_report("expert_gemm_ops.cu", tmp_path)
    for warning in ("C7510", "C7507", "C7518", "C7515"):
        assert warning not in log, log
    # The mangled name carries the epilogue's and the A source's class names.
    gemms = [(name, spill) for name, spill in found if "GemmKernelSm90" in name]
    assert gemms, log[-4000:]
    # Both dispatching forms, at both cluster sizes ("PeerDispatchRingA" also matches "DispatchRingA").
    assert sum("PeerDispatchRingA" in name for name, _ in gemms) == 2, [name for name, _ in gemms]
    assert sum("DispatchRingA" in name for name, _ in gemms) == 4, [name for name, _ in gemms]
    for name, spill in gemms:
        if "Wgrad" in name:
            limit = 0
        elif "DispatchRingA" in name:
            limit = 64
        elif "Swiglu" in name:
            limit = 32
        else:
            limit = 16
        assert spill <= limit, f"{spill} bytes spilled (limit {limit}) in {name}"
