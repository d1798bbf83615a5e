"""The FP8 quantization ops' argument checks on the CPU (ops.fp8_quantize_rows, fp8_quantize_swiglu,
fp8_quantize_columns, fp8_quantize_columns_from_peers, fp8_quantize_swiglu_columns,
fp8_quantize_swiglu_backward, fp8_quantize_swiglu_backward_copies, fp8_quantize_weight, fp8_transpose_weight:
types, dtypes, shapes, the multiple of
128, contiguity and alignment before devices, so every error but the device's shows without a GPU and
before any kernel runs), and their references' layouts on CPU tensors. The kernels against the references: tests/ops/test_gpu_fp8_quant.py."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import ops, quantization
from megatron_mok.limits import fp8_scale_rows
from cuda_checks import NEEDS_TOOLCHAIN

E4M3 = torch.float8_e4m3fn
R, C = 10, 256


def rows_args(**changes):
    args = dict(x=torch.zeros(R, C, dtype=torch.bfloat16), row_index=None, source_scales=True, gemm_a_scales=True,
                pow2=False)
    args.update(changes)
    return args


def columns_args(**changes):
    args = dict(x=torch.zeros(R, C, dtype=torch.bfloat16), expert_offsets=None, pow2=False)
    args.update(changes)
    return args


def swiglu_args(**changes):
    args = dict(gate_up=torch.zeros(R, C, dtype=torch.bfloat16), expert_offsets=torch.tensor([0, R], dtype=torch.int32),
                pow2=False)
    args.update(changes)
    return args


def swiglu_backward_args(**changes):
    args = dict(gate_up=torch.zeros(R, C, dtype=torch.bfloat16), grad_act=torch.zeros(R, C // 2, dtype=torch.bfloat16),
                expert_offsets=torch.tensor([0, R], dtype=torch.int32), pow2=False)
    args.update(changes)
    return args


def weight_args(**changes):
    args = dict(weight=torch.zeros(2, 256, 384, dtype=torch.bfloat16), transposed=True, pow2=False)
    args.update(changes)
    return args


def transpose_args(**changes):
    args = dict(q=torch.zeros(2, 256, 384, dtype=E4M3), scales=torch.ones(2, 2, 3))
    args.update(changes)
    return args


def _misaligned(rows: int, cols: int) -> torch.Tensor:
    """A contiguous bf16 (rows, cols) view whose data starts 2 bytes into its storage."""
    return torch.zeros(rows * cols + 1, dtype=torch.bfloat16)[1:].view(rows, cols)


# name: (op, argument builder, the changed arguments, the error's words)
BAD_ARGS = {
    "rows_x_not_tensor": ("fp8_quantize_rows", rows_args, dict(x=[[0.0] * C]), "x must be a tensor"),
    "rows_x_fp32": ("fp8_quantize_rows", rows_args, dict(x=torch.zeros(R, C)), "x must be torch.bfloat16"),
    "rows_x_3d": ("fp8_quantize_rows", rows_args, dict(x=torch.zeros(1, R, C, dtype=torch.bfloat16)),
                  r"x must be \(R, C\)"),
    "rows_c_not_multiple": ("fp8_quantize_rows", rows_args, dict(x=torch.zeros(R, 192, dtype=torch.bfloat16)),
                            r"x's columns \(C\) must be a positive multiple of 128 .* got 192"),
    "rows_c_zero": ("fp8_quantize_rows", rows_args, dict(x=torch.zeros(R, 0, dtype=torch.bfloat16)),
                    r"x's columns \(C\) must be a positive multiple of 128"),
    "rows_index_list": ("fp8_quantize_rows", rows_args, dict(row_index=[0, 1]), "row_index must be a tensor or None"),
    "rows_index_int32": ("fp8_quantize_rows", rows_args, dict(row_index=torch.zeros(4, dtype=torch.int32)),
                         "row_index must be torch.int64"),
    "rows_index_2d": ("fp8_quantize_rows", rows_args, dict(row_index=torch.zeros(2, 2, dtype=torch.int64)),
                      r"row_index must be \(R,\)"),
    "rows_flag_int": ("fp8_quantize_rows", rows_args, dict(pow2=1), "pow2 must be a bool"),
    "rows_no_layout": ("fp8_quantize_rows", rows_args, dict(source_scales=False, gemm_a_scales=False),
                       "at least one of source_scales and gemm_a_scales"),
    "rows_x_not_contiguous": ("fp8_quantize_rows", rows_args, dict(x=torch.zeros(C, R, dtype=torch.bfloat16).t()),
                              "x must be contiguous"),
    "rows_index_not_contiguous": ("fp8_quantize_rows", rows_args,
                                  dict(row_index=torch.zeros(8, dtype=torch.int64)[::2]), "row_index must be contiguous"),
    "rows_x_misaligned": ("fp8_quantize_rows", rows_args, dict(x=_misaligned(R, C)), "x must start 16-byte aligned"),
    "rows_cpu": ("fp8_quantize_rows", rows_args, {}, "x must be a CUDA tensor"),
    "columns_x_fp16": ("fp8_quantize_columns", columns_args, dict(x=torch.zeros(R, C, dtype=torch.float16)),
                       "x must be torch.bfloat16"),
    "columns_c_not_multiple": ("fp8_quantize_columns", columns_args, dict(x=torch.zeros(R, 100, dtype=torch.bfloat16)),
                               r"x's columns \(C\) must be a positive multiple of 128"),
    "columns_offsets_int64": ("fp8_quantize_columns", columns_args, dict(expert_offsets=torch.zeros(3, dtype=torch.int64)),
                              "expert_offsets must be torch.int32"),
    "columns_offsets_empty": ("fp8_quantize_columns", columns_args,
                              dict(expert_offsets=torch.zeros(0, dtype=torch.int32)), r"expert_offsets must be \(E \+ 1,\)"),
    "columns_flag_none": ("fp8_quantize_columns", columns_args, dict(pow2=None), "pow2 must be a bool"),
    "columns_cpu": ("fp8_quantize_columns", columns_args, {}, "x must be a CUDA tensor"),
    "columns_index_int32": ("fp8_quantize_columns", columns_args, dict(row_index=torch.zeros(4, dtype=torch.int32)),
                            "row_index must be torch.int64"),
    "columns_index_2d": ("fp8_quantize_columns", columns_args, dict(row_index=torch.zeros(2, 2, dtype=torch.int64)),
                         r"row_index must be \(R,\)"),
    "columns_index_strided": ("fp8_quantize_columns", columns_args, dict(row_index=torch.zeros(8, dtype=torch.int64)[::2]),
                              "row_index must be contiguous"),
    "columns_weights_without_index": ("fp8_quantize_columns", columns_args, dict(row_weights=torch.ones(4)),
                                      "row_weights needs row_index"),
    "columns_weights_bf16": ("fp8_quantize_columns", columns_args,
                             dict(row_index=torch.zeros(4, dtype=torch.int64), row_weights=torch.ones(4, dtype=torch.bfloat16)),
                             "row_weights must be torch.float32"),
    "columns_weights_length": ("fp8_quantize_columns", columns_args,
                               dict(row_index=torch.zeros(4, dtype=torch.int64), row_weights=torch.ones(5)),
                               r"row_weights must have row_index's shape \(4,\), got \(5,\)"),
    "columns_weights_strided": ("fp8_quantize_columns", columns_args,
                                dict(row_index=torch.zeros(4, dtype=torch.int64), row_weights=torch.ones(8)[::2]),
                                "row_weights must be contiguous"),
    "swiglu_gate_up_fp32": ("fp8_quantize_swiglu", swiglu_args, dict(gate_up=torch.zeros(R, C)),
                            "gate_up must be torch.bfloat16"),
    "swiglu_f_not_multiple": ("fp8_quantize_swiglu", swiglu_args, dict(gate_up=torch.zeros(R, 384, dtype=torch.bfloat16)),
                              r"gate_up's columns \(2F\) must be twice a positive multiple of 128 .* got 384"),
    "swiglu_offsets_missing": ("fp8_quantize_swiglu", swiglu_args, dict(expert_offsets=None),
                               "expert_offsets must be a tensor"),
    "swiglu_offsets_int64": ("fp8_quantize_swiglu", swiglu_args, dict(expert_offsets=torch.zeros(3, dtype=torch.int64)),
                             "expert_offsets must be torch.int32"),
    "swiglu_flag_int": ("fp8_quantize_swiglu", swiglu_args, dict(pow2=0), "pow2 must be a bool"),
    "swiglu_not_contiguous": ("fp8_quantize_swiglu", swiglu_args,
                              dict(gate_up=torch.zeros(C, R, dtype=torch.bfloat16).t()), "gate_up must be contiguous"),
    "swiglu_cpu": ("fp8_quantize_swiglu", swiglu_args, {}, "gate_up must be a CUDA tensor"),
    "swiglu_columns_f_not_multiple": ("fp8_quantize_swiglu_columns", swiglu_args,
                                      dict(gate_up=torch.zeros(R, 384, dtype=torch.bfloat16)),
                                      r"gate_up's columns \(2F\) must be twice a positive multiple of 128"),
    "swiglu_columns_offsets_missing": ("fp8_quantize_swiglu_columns", swiglu_args, dict(expert_offsets=None),
                                       "expert_offsets must be a tensor"),
    "swiglu_columns_cpu": ("fp8_quantize_swiglu_columns", swiglu_args, {},
                           "gate_up must be a CUDA tensor"),
    "swiglu_backward_f_not_multiple": ("fp8_quantize_swiglu_backward", swiglu_backward_args,
                                       dict(gate_up=torch.zeros(R, 384, dtype=torch.bfloat16),
                                            grad_act=torch.zeros(R, 192, dtype=torch.bfloat16)),
                                       r"gate_up's columns \(2F\) must be twice a positive multiple of 128"),
    "swiglu_backward_grad_fp32": ("fp8_quantize_swiglu_backward", swiglu_backward_args,
                                  dict(grad_act=torch.zeros(R, C // 2)), "grad_act must be torch.bfloat16"),
    "swiglu_backward_grad_missing": ("fp8_quantize_swiglu_backward", swiglu_backward_args, dict(grad_act=None),
                                     "grad_act must be a tensor"),
    "swiglu_backward_grad_rows": ("fp8_quantize_swiglu_backward", swiglu_backward_args,
                                  dict(grad_act=torch.zeros(R + 1, C // 2, dtype=torch.bfloat16)),
                                  r"grad_act must be \(R, F\) = \(10, 128\) for gate_up \(10, 256\), got \(11, 128\)"),
    "swiglu_backward_grad_columns": ("fp8_quantize_swiglu_backward", swiglu_backward_args,
                                     dict(grad_act=torch.zeros(R, C, dtype=torch.bfloat16)),
                                     r"grad_act must be \(R, F\) = \(10, 128\)"),
    "swiglu_backward_grad_not_contiguous": ("fp8_quantize_swiglu_backward", swiglu_backward_args,
                                            dict(grad_act=torch.zeros(C // 2, R, dtype=torch.bfloat16).t()),
                                            "grad_act must be contiguous"),
    "swiglu_backward_grad_misaligned": ("fp8_quantize_swiglu_backward", swiglu_backward_args,
                                        dict(grad_act=_misaligned(R, C // 2)), "grad_act must start 16-byte aligned"),
    "swiglu_backward_offsets_int64": ("fp8_quantize_swiglu_backward", swiglu_backward_args,
                                      dict(expert_offsets=torch.zeros(3, dtype=torch.int64)),
                                      "expert_offsets must be torch.int32"),
    "swiglu_backward_flag_int": ("fp8_quantize_swiglu_backward", swiglu_backward_args, dict(pow2=1),
                                 "pow2 must be a bool"),
    "swiglu_backward_cpu": ("fp8_quantize_swiglu_backward", swiglu_backward_args, {}, "gate_up must be a CUDA tensor"),
    # (the one-pass form's checks are the same, under its own name)
    "swiglu_backward_copies_f_not_multiple": ("fp8_quantize_swiglu_backward_copies", swiglu_backward_args,
                                              dict(gate_up=torch.zeros(R, 384, dtype=torch.bfloat16),
                                                   grad_act=torch.zeros(R, 192, dtype=torch.bfloat16)),
                                              r"gate_up's columns \(2F\) must be twice a positive multiple of 128"),
    "swiglu_backward_copies_grad_rows": ("fp8_quantize_swiglu_backward_copies", swiglu_backward_args,
                                         dict(grad_act=torch.zeros(R + 1, C // 2, dtype=torch.bfloat16)),
                                         r"grad_act must be \(R, F\) = \(10, 128\) for gate_up \(10, 256\)"),
    "swiglu_backward_copies_grad_misaligned": ("fp8_quantize_swiglu_backward_copies", swiglu_backward_args,
                                               dict(grad_act=_misaligned(R, C // 2)),
                                               "grad_act must start 16-byte aligned"),
    "swiglu_backward_copies_offsets_missing": ("fp8_quantize_swiglu_backward_copies", swiglu_backward_args,
                                               dict(expert_offsets=None), "expert_offsets must be a tensor"),
    "swiglu_backward_copies_flag_int": ("fp8_quantize_swiglu_backward_copies", swiglu_backward_args, dict(pow2=1),
                                        "pow2 must be a bool"),
    "swiglu_backward_copies_act_int": ("fp8_quantize_swiglu_backward_copies", swiglu_backward_args,
                                       dict(act_columns=1), "act_columns must be a bool"),
    "swiglu_backward_copies_cpu": ("fp8_quantize_swiglu_backward_copies", swiglu_backward_args, {},
                                   "gate_up must be a CUDA tensor"),
    "weight_not_tensor": ("fp8_quantize_weight", weight_args, dict(weight=1.0), "weight must be a tensor"),
    "weight_fp16": ("fp8_quantize_weight", weight_args, dict(weight=torch.zeros(2, 256, 384, dtype=torch.float16)),
                    "weight must be torch.bfloat16 or torch.float32"),
    "weight_2d": ("fp8_quantize_weight", weight_args, dict(weight=torch.zeros(256, 384, dtype=torch.bfloat16)),
                  r"weight must be \(E, N, K\)"),
    "weight_n_not_multiple": ("fp8_quantize_weight", weight_args,
                              dict(weight=torch.zeros(2, 200, 384, dtype=torch.bfloat16)),
                              r"N \(weight's rows per expert\) must be a positive multiple of 128 .* got 200"),
    "weight_k_not_multiple": ("fp8_quantize_weight", weight_args,
                              dict(weight=torch.zeros(2, 256, 96, dtype=torch.bfloat16)),
                              r"K \(weight's columns\) must be a positive multiple of 128 .* got 96"),
    "weight_flag_str": ("fp8_quantize_weight", weight_args, dict(transposed="yes"), "transposed must be a bool"),
    "weight_no_copy": ("fp8_quantize_weight", weight_args, dict(transposed=False, forward_copy=False),
                       "forward_copy or transposed must be True"),
    "weight_not_contiguous": ("fp8_quantize_weight", weight_args,
                              dict(weight=torch.zeros(2, 384, 256, dtype=torch.bfloat16).transpose(1, 2)),
                              "weight must be contiguous"),
    "weight_cpu": ("fp8_quantize_weight", weight_args, {}, "weight must be a CUDA tensor"),
    "transpose_q_bf16": ("fp8_transpose_weight", transpose_args, dict(q=torch.zeros(2, 256, 384, dtype=torch.bfloat16)),
                         "q must be torch.float8_e4m3fn"),
    "transpose_q_2d": ("fp8_transpose_weight", transpose_args, dict(q=torch.zeros(256, 384, dtype=E4M3)),
                       r"q must be \(E, N, K\)"),
    "transpose_n_not_multiple": ("fp8_transpose_weight", transpose_args, dict(q=torch.zeros(2, 200, 384, dtype=E4M3)),
                                 r"N \(q's rows per expert\) must be a positive multiple of 128 .* got 200"),
    "transpose_scales_fp16": ("fp8_transpose_weight", transpose_args, dict(scales=torch.ones(2, 2, 3, dtype=torch.float16)),
                              "scales must be torch.float32"),
    "transpose_scales_shape": ("fp8_transpose_weight", transpose_args, dict(scales=torch.ones(2, 3, 2)),
                               r"scales must be \(E, N/128, K/128\) = \(2, 2, 3\)"),
    "transpose_q_not_contiguous": ("fp8_transpose_weight", transpose_args,
                                   dict(q=torch.zeros(2, 384, 256, dtype=E4M3).transpose(1, 2)), "q must be contiguous"),
    "transpose_cpu": ("fp8_transpose_weight", transpose_args, {}, "q must be a CUDA tensor"),
    "weight_offsets_int64": ("fp8_quantize_weight", weight_args, dict(expert_offsets=torch.zeros(3, dtype=torch.int64)),
                             "expert_offsets must be torch.int32"),
    "weight_offsets_length": ("fp8_quantize_weight", weight_args, dict(expert_offsets=torch.zeros(2, dtype=torch.int32)),
                              r"expert_offsets must be \(E \+ 1,\) = \(3,\) for 2 experts, got \(2,\)"),
    "transpose_offsets_2d": ("fp8_transpose_weight", transpose_args,
                             dict(expert_offsets=torch.zeros(1, 3, dtype=torch.int32)), r"expert_offsets must be \(E \+ 1,\)"),
    "transpose_offsets_length": ("fp8_transpose_weight", transpose_args,
                                 dict(expert_offsets=torch.zeros(4, dtype=torch.int32)),
                                 r"expert_offsets must be \(E \+ 1,\) = \(3,\) for 2 experts, got \(4,\)"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_argument_is_a_value_error_naming_it(case):
    op, build, changes, words = BAD_ARGS[case]
    args = build(**changes)
    keywords = ("source_scales", "gemm_a_scales", "pow2", "transposed", "forward_copy", "act_columns")
    if op in ("fp8_quantize_weight", "fp8_transpose_weight"):
        keywords += ("expert_offsets",)
    if op == "fp8_quantize_columns":
        keywords += ("row_index", "row_weights")  # keyword-only there
    flags = {name: args.pop(name) for name in keywords if name in args}
    with pytest.raises(ValueError, match=f"{op}: {words}"):
        getattr(ops, op)(*args.values(), **flags)


def _aligned_address(rank: int) -> int:
    return 0x7F0000000000 + 4096 * rank  # (never read: every case fails before a kernel runs)


# name: (changes to fp8_quantize_columns_from_peers' arguments, the words its ValueError must hold)
BAD_PEER_COLUMNS_ARGS = {
    "peers_not_a_list": (dict(peer_ptrs=_aligned_address(0)), "peer_ptrs must be a list of 1 to 8 device addresses"),
    "peers_empty": (dict(peer_ptrs=[]), "peer_ptrs must be a list of 1 to 8 device addresses"),
    "peers_too_many": (dict(peer_ptrs=[_aligned_address(r) for r in range(9)]),
                       "peer_ptrs must be a list of 1 to 8 device addresses"),
    "peer_null": (dict(peer_ptrs=[_aligned_address(0), 0]), r"peer_ptrs\[1\] must be a non-null 16-byte aligned"),
    "peer_misaligned": (dict(peer_ptrs=[_aligned_address(0) + 8]), r"peer_ptrs\[0\] must be a non-null 16-byte aligned"),
    "peer_not_int": (dict(peer_ptrs=[float(_aligned_address(0))]), r"peer_ptrs\[0\] must be a non-null"),
    "peer_bool": (dict(peer_ptrs=[True]), r"peer_ptrs\[0\] must be a non-null"),
    "index_missing": (dict(row_index=None), "row_index is required"),
    "index_int32": (dict(row_index=torch.zeros(4, dtype=torch.int32)), "row_index must be torch.int64"),
    "own_fp32": (dict(own=torch.zeros(R, C)), "own must be torch.bfloat16"),
    "own_c_not_multiple": (dict(own=torch.zeros(R, 100, dtype=torch.bfloat16)),
                           r"own's columns \(C\) must be a positive multiple of 128"),
    "weights_length": (dict(row_weights=torch.ones(3)), r"row_weights must have row_index's shape \(4,\)"),
    "own_cpu": ({}, "own must be a CUDA tensor"),
}


@pytest.mark.parametrize("case", list(BAD_PEER_COLUMNS_ARGS))
def test_bad_columns_from_peers_argument_is_a_value_error_naming_it(case):
    """ops.fp8_quantize_columns_from_peers checks its region table (one to MAX_EP_RANKS non-null
    16-byte aligned int addresses), its required row index and fp8_quantize_columns' checks under the
    names it uses (own for x) before any kernel runs."""
    changes, words = BAD_PEER_COLUMNS_ARGS[case]
    args = dict(own=torch.zeros(R, C, dtype=torch.bfloat16), peer_ptrs=[_aligned_address(0), _aligned_address(1)],
                expert_offsets=None, pow2=False, row_index=torch.zeros(4, dtype=torch.int64), row_weights=None)
    args.update(changes)
    with pytest.raises(ValueError, match=f"fp8_quantize_columns_from_peers: {words}"):
        ops.fp8_quantize_columns_from_peers(args.pop("own"), args.pop("peer_ptrs"), args.pop("expert_offsets"), **args)


def gate_up_ending_at(rows, end, seed):
    """(gate_up (rows, 2C) bf16 with NaN rows from `end` on, past the schedule's end: not part of the
    result; offsets (3,) int32 ending at `end`)."""
    gate_up = torch.randn(rows, 2 * C, generator=torch.Generator().manual_seed(seed)).bfloat16()
    gate_up[end:] = float("nan")
    return gate_up, torch.tensor([0, end // 2, end], dtype=torch.int32)


def test_swiglu_reference_is_swiglu_then_quantize_rowwise_with_rows_past_the_end_zero():
    gate_up, offsets = gate_up_ending_at(9, 6, seed=1)
    act, act_scales = ops.fp8_quantize_swiglu_reference(gate_up, offsets)
    gate, up = gate_up[:6].float().chunk(2, dim=-1)
    want_q, want_scales = quantization.quantize_rowwise((torch.nn.functional.silu(gate) * up).bfloat16())
    assert torch.equal(act[:6].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(act_scales[:, :6], want_scales.t())
    assert not bool(act[6:].view(torch.uint8).any()) and bool((act_scales[:, 6:] == 1).all())
    assert act_scales.shape == (C // 128, fp8_scale_rows(9))


def test_swiglu_columns_reference_is_swiglu_then_quantize_columnwise_with_rows_past_the_end_zero():
    gate_up, offsets = gate_up_ending_at(150, 140, seed=2)
    q, scales = ops.fp8_quantize_swiglu_columns_reference(gate_up, offsets)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = torch.zeros(256, C, dtype=torch.bfloat16)
    act[:140] = (torch.nn.functional.silu(gate[:140]) * up[:140]).bfloat16()
    want_q, want_scales = quantization.quantize_columnwise(act)
    assert q.shape == (C, 256) and scales.shape == (2, C)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)


def test_swiglu_backward_reference_is_swiglu_backward_then_quantize_rowwise_with_rows_past_the_end_zero():
    """d gate_up = the reference backend's SwiGLU backward, rows at or past the end zero (gate_up and
    grad_act are NaN there), and its quantization 1x128 along 2F with GEMM-A scales."""
    from megatron_mok.backends import reference

    gate_up, offsets = gate_up_ending_at(150, 140, seed=3)
    grad_act = torch.randn(150, C, generator=torch.Generator().manual_seed(4)).bfloat16()
    grad_act[140:] = float("nan")
    grad_gate_up, q, scales = ops.fp8_quantize_swiglu_backward_reference(gate_up, grad_act, offsets)
    want = torch.zeros(150, 2 * C, dtype=torch.bfloat16)
    want[:140] = reference.swiglu_backward(gate_up[:140], grad_act[:140])
    assert torch.equal(grad_gate_up, want)
    want_q, want_scales = quantization.quantize_rowwise(want)
    assert q.shape == (150, 2 * C) and scales.shape == (2 * C // 128, fp8_scale_rows(150))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, quantization.gemm_a_scales(want_scales))
    assert not bool(q[140:].view(torch.uint8).any()) and bool((scales[:, 140:] == 1).all())


def test_swiglu_backward_copies_reference_is_both_quantizations_of_the_swiglu_backward():
    """The one-pass form's reference: the row copy of fp8_quantize_swiglu_backward_reference and the
    column copy (quantize_columnwise over the rows padded to 128) of its d gate_up, and act's column
    copy (SwiGLU of gate_up rounded to bf16), rows at or past the end zero in each (gate_up and
    grad_act are NaN there)."""
    from megatron_mok.backends import reference

    gate_up, offsets = gate_up_ending_at(150, 140, seed=5)
    grad_act = torch.randn(150, C, generator=torch.Generator().manual_seed(6)).bfloat16()
    grad_act[140:] = float("nan")
    rows_q, rows_scales, columns_q, columns_scales, act_q, act_scales = ops.fp8_quantize_swiglu_backward_copies_reference(
        gate_up, grad_act, offsets, act_columns=True)
    want_act = torch.zeros(256, C, dtype=torch.bfloat16)
    gate, up = gate_up[:140].float().chunk(2, dim=-1)
    want_act[:140] = (torch.nn.functional.silu(gate) * up).bfloat16()
    want_act_q, want_act_scales = quantization.quantize_columnwise(want_act)
    assert torch.equal(act_q.view(torch.uint8), want_act_q.view(torch.uint8)) and torch.equal(act_scales, want_act_scales)
    assert ops.fp8_quantize_swiglu_backward_copies_reference(gate_up, grad_act, offsets)[4:] == (None, None)
    want = torch.zeros(256, 2 * C, dtype=torch.bfloat16)  # padded to two 128-row blocks
    want[:140] = reference.swiglu_backward(gate_up[:140], grad_act[:140])
    want_rows_q, want_rows_scales = quantization.quantize_rowwise(want[:150])
    assert torch.equal(rows_q.view(torch.uint8), want_rows_q.view(torch.uint8))
    assert torch.equal(rows_scales, quantization.gemm_a_scales(want_rows_scales))
    want_columns_q, want_columns_scales = quantization.quantize_columnwise(want)
    assert columns_q.shape == (2 * C, 256) and columns_scales.shape == (2, 2 * C)
    assert torch.equal(columns_q.view(torch.uint8), want_columns_q.view(torch.uint8))
    assert torch.equal(columns_scales, want_columns_scales)
    assert not bool(columns_q[:, 140:].view(torch.uint8).any())


def test_rows_reference_gathers_and_zero_fills():
    """Row r of the reference is x[row_index[r]] quantized, and a -1 row is all zeros with scale 1;
    the GEMM-A layout is the source layout transposed with padding columns 1."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, C, generator=g).bfloat16()
    index = torch.tensor([4, -1, 0, 0, 2, -1, 3])
    q, scales, gemm_a = ops.fp8_quantize_rows_reference(x, index)
    want_q, want_scales = quantization.quantize_rowwise(x)
    for r, i in enumerate(index.tolist()):
        if i < 0:
            assert torch.all(q[r].float() == 0) and torch.all(scales[r] == 1)
        else:
            assert torch.equal(q[r].view(torch.uint8), want_q[i].view(torch.uint8)) and torch.equal(scales[r], want_scales[i])
    assert gemm_a.shape == (C // 128, fp8_scale_rows(7))
    assert torch.equal(gemm_a[:, :7], scales.t()) and torch.all(gemm_a[:, 7:] == 1)


def test_columns_reference_masks_the_tail_and_pads():
    """Rows at or past expert_offsets[-1] and the padding to 128 rows quantize as zeros: the
    reference equals quantize_columnwise of the zero-filled, padded matrix, and a NaN in the masked
    tail reaches nothing."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, C, generator=g).bfloat16()
    x[290:] = float("nan")  # past the schedule's end: never read
    offsets = torch.tensor([0, 128, 128, 290], dtype=torch.int32)
    q, scales = ops.fp8_quantize_columns_reference(x, offsets)
    assert q.shape == (C, 384) and scales.shape == (3, C)
    padded = torch.zeros(384, C, dtype=torch.bfloat16)
    padded[:290] = x[:290]
    want_q, want_scales = quantization.quantize_columnwise(padded)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert torch.isfinite(scales).all()


def test_gathered_columns_reference_is_the_columns_of_the_gathered_rows():
    """With row_index, the reference quantizes x[row_index[r]] (-1: a zero row) as the rows."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, C, generator=g).bfloat16()
    index = torch.tensor([8, -1, 0, 0, 3] * 30)
    offsets = torch.tensor([0, 128, 140], dtype=torch.int32)
    q, scales = ops.fp8_quantize_columns_reference(x, offsets, row_index=index)
    rows = torch.where((index >= 0).unsqueeze(1), x[index.clamp(min=0)], torch.zeros((), dtype=x.dtype))
    want_q, want_scales = ops.fp8_quantize_columns_reference(rows, offsets)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)


def test_weighted_gathered_columns_reference_is_the_columns_of_the_pulled_rows():
    """With row_weights, the reference quantizes the rows the weighted pull gives (the reference
    backend's pull_route_grads: w * dY of each route's token in fp32, rounded to bf16; padding rows
    zero), so the fc2 weight gradient's operand is the same bytes either way."""
    import types

    from megatron_mok.backends import reference

    g = torch.Generator().manual_seed(3)
    topk, tokens = 2, 9
    grad_y = torch.randn(tokens, C, generator=g).bfloat16()
    weights = torch.rand(tokens, topk, generator=g)
    route = torch.tensor([17, -1, 0, 5, 5, 3, -1, 16] * 20)
    offsets = torch.tensor([0, 128, 150], dtype=torch.int32)
    source = types.SimpleNamespace(materialize=lambda: (grad_y, weights.reshape(-1)))
    pulled = reference.pull_route_grads(source, types.SimpleNamespace(slot_to_route=route, topk=topk))
    token = torch.where(route >= 0, route // topk, route)
    q, scales = ops.fp8_quantize_columns_reference(grad_y, offsets, row_index=token,
                                                   row_weights=weights.reshape(-1)[route.clamp(min=0)])
    want_q, want_scales = ops.fp8_quantize_columns_reference(pulled, offsets)
    # (Compared as values: the reference pull's padding rows are w = 0 times a row, so -0 where the
    # row is negative, and the op's zero rows +0; the kernels write +0 both ways.)
    assert torch.equal(q.float(), want_q.float()) and torch.equal(scales, want_scales)


def test_weight_reference_transposed_copy_is_the_transposed_quantization():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 256, 384, generator=g).bfloat16()
    q, scales, q_t, scales_t = ops.fp8_quantize_weight_reference(w)
    want_q_t, want_scales_t = quantization.quantize_weight(w.transpose(1, 2).contiguous())
    assert torch.equal(q_t.view(torch.uint8), want_q_t.view(torch.uint8)) and torch.equal(scales_t, want_scales_t)
    assert q.shape == (2, 256, 384) and scales.shape == (2, 2, 3)


def test_transpose_reference_is_the_transposed_quantization():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 256, 384, generator=g).bfloat16()
    q, scales, want_q_t, want_scales_t = ops.fp8_quantize_weight_reference(w)
    q_t, scales_t = ops.fp8_transpose_weight_reference(q, scales)
    assert torch.equal(q_t.view(torch.uint8), want_q_t.view(torch.uint8)) and torch.equal(scales_t, want_scales_t)


# Spill bytes a kernel is known to need, by the name its entry function's mangled name contains:
# none. (The SwiGLU backward's per-value IEEE divisions used to keep call frames at its register
# budget, 16 bytes; the batched fast path of common/swiglu_math.cuh calls the division only where a
# value leaves its range, docs/log/changes_2026-12-08.md.)
KNOWN_SPILL_BYTES: dict[str, int] = {}


@NEEDS_TOOLCHAIN
def test_kernels_compile_without_new_spills(tmp_path):
    """ptxas's verdict on every quantization kernel the bindings instantiate (csrc/bindings/
    fp8_quant_ops.cu compiled as setup.py does): the row, SwiGLU, SwiGLU backward (and its one-pass
    form with both copies), column (plain,
    gathered, weighted, from the SwiGLU act, gathered and weighted from the ranks' regions), weight (bf16 and fp32) and transpose kernels, none
    spilling beyond KNOWN_SPILL_BYTES. They are memory-bound: a spill inside their per-value loop
    costs a local-memory round trip per value."""
    from cuda_checks import ptxas_report

    log, found = ptxas_report("fp8_quant_ops.cu", tmp_path)
    names = {name: spill for name, spill in found}
    for kernel in ("quantize_rows_kernel", "quantize_swiglu_kernel", "quantize_swiglu_backward_kernel",
                   "quantize_swiglu_backward_tiles_kernel",
                   "quantize_columns_kernel", "PeerFp8QuantizeColumnsParams", "quantize_weight_kernel",
                   "transpose_weight_kernel"):
        assert any(kernel in name for name in names), (kernel, list(names))
    for name, spill in names.items():
        allowed = next((b for kernel, b in KNOWN_SPILL_BYTES.items() if kernel in name), 0)
        assert spill <= allowed, f"{spill} bytes spilled in {name} (allowed {allowed})"
