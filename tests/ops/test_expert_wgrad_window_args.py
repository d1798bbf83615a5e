"""ops.expert_gemm_wgrad_window's argument checks and the size of its carries, on the CPU: the
wrapper checks shapes, dtypes and the window's alignment before devices, so every error but the
device's shows without a GPU (the kernel's own checks: tests/ops/test_gpu_expert_wgrad_window.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import limits, ops

M, N, W, E = 64, 256, 128, 3
NUMEL = ops.wgrad_carry_numel(M, N)


def window_args(**changes):
    """Valid arguments (but for the device: CPU tensors), with `changes` applied."""
    args = dict(
        grad=torch.zeros(W, M, dtype=torch.bfloat16),
        inputs=torch.zeros(W, N, dtype=torch.bfloat16),
        expert_offsets=torch.tensor([0, 64, 192, 384], dtype=torch.int32),
        window_begin=128,
        last_window=False,
        out=torch.zeros(E, M, N, dtype=torch.bfloat16),
        carry_in=torch.zeros(NUMEL),
        carry_out=torch.zeros(NUMEL),
    )
    args.update(changes)
    return args


_SHARED = torch.zeros(NUMEL)

# name: (the changed arguments, the error's words)
BAD_ARGS = {
    "grad_fp32": (dict(grad=torch.zeros(W, M)), "grad must be a 2-D bfloat16 tensor"),
    "inputs_1d": (dict(inputs=torch.zeros(W * N, dtype=torch.bfloat16)), "inputs must be a 2-D bfloat16 tensor"),
    "rows_differ": (dict(inputs=torch.zeros(W - 8, N, dtype=torch.bfloat16)), "must have the same rows"),
    "empty_window": (dict(grad=torch.zeros(0, M, dtype=torch.bfloat16), inputs=torch.zeros(0, N, dtype=torch.bfloat16)),
                     "at least one row"),
    "m_not_multiple_of_8": (dict(grad=torch.zeros(W, 60, dtype=torch.bfloat16)), "positive multiples of 8"),
    "offsets_int64": (dict(expert_offsets=torch.tensor([0, 64, 192, 384])), "expert_offsets must be int32"),
    "no_expert": (dict(expert_offsets=torch.tensor([0], dtype=torch.int32)), "at least one expert"),
    "window_begin_unaligned": (dict(window_begin=96), "window_begin must be a non-negative multiple of 64"),
    "window_begin_negative": (dict(window_begin=-64), "window_begin must be a non-negative multiple of 64"),
    "window_begin_float": (dict(window_begin=128.0), "window_begin must be an int"),
    "window_begin_bool": (dict(window_begin=True), "window_begin must be an int"),
    "window_past_2_31": (dict(window_begin=(1 << 31) - 64), "window_begin \\+ W must be below 2\\^31"),
    "last_window_int": (dict(last_window=1), "last_window must be a bool"),
    "out_shape": (dict(out=torch.zeros(E, N, M, dtype=torch.bfloat16)), r"out must be bfloat16 \(E, m, n\)"),
    "out_fp32": (dict(out=torch.zeros(E, M, N)), r"out must be bfloat16 \(E, m, n\)"),
    "carry_in_size": (dict(carry_in=torch.zeros(M * N + 1)), r"carry_in must be None or float32 \(wgrad_carry_numel"),
    "carry_out_bf16": (dict(carry_out=torch.zeros(NUMEL, dtype=torch.bfloat16)), "carry_out must be None or float32"),
    "carry_out_2d": (dict(carry_out=torch.zeros(NUMEL // 256, 256)), "carry_out must be None or float32"),
    "same_carry_buffer": (dict(carry_in=_SHARED, carry_out=_SHARED), "carry_in and carry_out must not share storage"),
    "carry_views_of_one_buffer": (dict(carry_in=_SHARED, carry_out=_SHARED.view(-1)),
                                  "carry_in and carry_out must not share storage"),
    "grad_not_contiguous": (dict(grad=torch.zeros(M, W, dtype=torch.bfloat16).t()), "grad must be contiguous"),
    "cpu_tensors": ({}, r"grad must be a CUDA tensor on grad's device"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_argument_is_a_value_error_naming_it(case):
    changes, words = BAD_ARGS[case]
    with pytest.raises(ValueError, match=words):
        ops.expert_gemm_wgrad_window(**window_args(**changes))


def test_carries_may_be_none_up_to_the_device_check():
    with pytest.raises(ValueError, match="CUDA tensor"):
        ops.expert_gemm_wgrad_window(**window_args(carry_in=None, carry_out=None))


# (m, n): the carry's floats, m and n rounded up to the 128 x 256 tile.
CARRY_NUMELS = {(8, 8): 128 * 256, (128, 256): 128 * 256, (200, 328): 256 * 512, (4096, 7168): 4096 * 7168}


@pytest.mark.parametrize("shape", list(CARRY_NUMELS))
def test_wgrad_carry_numel_is_whole_tiles(shape):
    assert ops.wgrad_carry_numel(*shape) == CARRY_NUMELS[shape]
    assert limits.wgrad_carry_numel is ops.wgrad_carry_numel
