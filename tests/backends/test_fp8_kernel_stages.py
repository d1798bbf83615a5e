"""The kernel backend's FP8 blockwise stages (backends/kernel_fp8.py) on CPU: the path's
logic with every op replaced by its reference (tests' `_sim_*` below, over the `*_reference` functions
of megatron_mok.ops and backends/reference.py), against the reference backend's FP8 layer.

The simulated ops behave as the kernels are specified to: rows at or past the schedule's end are
"unwritten" (filled with NaN here, so a stage that read them would poison its result), padding rows
of the dispatch are zero bytes with scale 0 (the reference writes scale 1), a GEMM returns its exact
recipe product rounded once to bf16. Under these the kernel stages compute the reference backend's
arithmetic step for step (same quantized operands, same fp32 promotion order, same roundings: the
module docstrings of reference_fp8.py and kernel_fp8.py), so the bar is bitwise equality; a wrong
layout, scale, weight copy or a read past the schedule's end breaks it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import zlib
from pathlib import Path

import pytest
import torch

from megatron_mok import MoKConfig, fp8_weights, functional, mok_moe, ops
from megatron_mok.backends import kernel_fp8, reference, resolve_backend, stages_for, tuning
from megatron_mok.ops import fp8_gemm, fp8_quant, fp8_wgrad
from megatron_mok.emulation import EmulatedGroup
from megatron_mok.memory_fp8 import weight_copy_bytes
from megatron_mok import quantization
from megatron_mok.quantization import E4M3, Fp8Recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
from test_emulation import assert_bitwise, make_problem as make_ranks_problem, run_concatenated, run_emulated  # noqa: E402
from test_fp8_layer import ROUTINGS, SHAPES, make_problem, run_layer  # noqa: E402
from oracle import Shape  # noqa: E402


def _end(offsets: torch.Tensor) -> int:
    return int(offsets[-1])  # (tests only: the kernels read it on the device)


def _unwritten(out: torch.Tensor, offsets) -> torch.Tensor:
    """out with its rows at or past the schedule's end as garbage: NaN (E4M3: its NaN byte)."""
    if offsets is None:
        return out
    out = out.clone()
    if out.dtype == E4M3:
        out.view(torch.uint8)[_end(offsets):] = 0x7F
    else:
        out[_end(offsets):] = float("nan")
    return out


def _gather(src, slot_to_route, topk, weights=None):
    if src.shape[0] == 0:  # a group without tokens: every row is padding (the kernel reads nothing)
        return src.new_zeros((slot_to_route.shape[0], src.shape[1]))
    valid = slot_to_route >= 0
    route = torch.where(valid, slot_to_route, 0)
    rows = src.index_select(0, route // topk)
    if weights is not None:
        rows = (rows.float() * weights.index_select(0, route).unsqueeze(1)).to(src.dtype)
    return torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=src.dtype))


def _sim_dispatch_rows(x_all, slot_to_route, topk, expert_offsets=None):
    return _unwritten(_gather(x_all, slot_to_route, topk), expert_offsets)


def _sim_pull_grad_rows(grad_y_all, weights_all, slot_to_route, topk, expert_offsets=None):
    return _unwritten(_gather(grad_y_all, slot_to_route, topk, weights_all), expert_offsets)


def _sim_fp8_expert_gemm(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, variant="default",
                         out=None):
    # Every mainloop variant gives the default's bits (tests/ops/test_gpu_fp8_gemm.py): one simulation.
    assert variant in fp8_gemm.FP8_GEMM_VARIANTS, variant
    _meets_the_op_contract(fp8_gemm.check_fp8_expert_gemm_args, a, a_scales, weight, weight_scales, expert_offsets,
                           cluster_m, group_m, "fp8_expert_gemm", False, out)
    product = ops.fp8_expert_gemm_reference(a, a_scales, weight, weight_scales, expert_offsets).bfloat16()
    if out is None:
        return _unwritten(product, expert_offsets)
    # Only the rows of the given segments are written (an expert range's launch into a shared output);
    # the rows past them hold NaN, as _unwritten leaves them, until a later range writes its own (the
    # ranges run in ascending order), so a stage that reads past the schedule's end is caught.
    begin, end = int(expert_offsets[0]), int(expert_offsets[-1])
    out[end:] = float("nan")
    out[begin:end] = product[begin:end]
    return out


def _sim_fp8_expert_gemm_swiglu(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, variant="default"):
    assert variant in fp8_gemm.FP8_SWIGLU_GEMM_VARIANTS, variant
    _meets_the_op_contract(fp8_gemm.check_fp8_expert_gemm_args, a, a_scales, weight, weight_scales, expert_offsets,
                           cluster_m, group_m, "fp8_expert_gemm_swiglu", True)
    gate_up, act, act_scales = ops.fp8_expert_gemm_swiglu_reference(a, a_scales, weight, weight_scales, expert_offsets)
    act_scales = act_scales.clone()
    act_scales[:, _end(expert_offsets):] = float("nan")
    return _unwritten(gate_up.bfloat16(), expert_offsets), _unwritten(act, expert_offsets), act_scales


def _sim_fp8_expert_gemm_swiglu_backward(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, *,
                                         gate_up, pow2=False, variant="default", out=None):
    """The product rounded to bf16, then fp8_quantize_swiglu_backward's simulation, on the rows of the
    given segments only: with `out`, the rows of other segments keep what they hold, and those past
    this launch's segments hold NaN until a later range writes them (as _sim_fp8_expert_gemm's)."""
    assert variant in fp8_gemm.FP8_SWIGLU_BACKWARD_GEMM_VARIANTS, variant
    _meets_the_op_contract(lambda *args: fp8_gemm.fp8_expert_gemm_swiglu_backward(
        *args, gate_up=gate_up, pow2=pow2, variant=variant, out=out),
        a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m)
    grad_act = ops.fp8_expert_gemm_reference(a, a_scales, weight, weight_scales, expert_offsets).bfloat16()
    made = _sim_fp8_quantize_swiglu_backward(gate_up, grad_act, expert_offsets, pow2=pow2)
    begin, end = int(expert_offsets[0]), int(expert_offsets[-1])
    if out is None:
        rows = a.shape[0]
        out = (torch.full_like(made[0], float("nan")), made[1].clone(), made[2].clone())
        out[1].view(torch.uint8)[:] = 0x7F
        out[2][:, :rows] = float("nan")
    out[0][end:] = float("nan")
    out[1].view(torch.uint8)[end:] = 0x7F
    out[2][:, end:a.shape[0]] = float("nan")
    out[0][begin:end] = made[0][begin:end]
    out[1][begin:end] = made[1][begin:end]
    out[2][:, begin:end] = made[2][:, begin:end]
    return out


def _zero_past_end(t, offsets):
    t = t.clone()
    t[_end(offsets):] = 0
    return t


def _sim_fp8_expert_wgrad(grad, grad_scales, inputs, inputs_scales, expert_offsets, out=None, *, accumulate=False,
                          window_begin=0, rounded=None, carry=None, variant="default"):
    _meets_the_op_contract(fp8_wgrad.check_fp8_expert_wgrad_args, grad, grad_scales, inputs, inputs_scales, expert_offsets,
                           out, accumulate, window_begin, rounded, variant, carry)
    if carry is not None:
        return _sim_fp8_expert_wgrad_windowed(grad, grad_scales, inputs, inputs_scales, expert_offsets, window_begin,
                                              rounded, carry)
    part = ops.fp8_expert_wgrad_reference(grad, grad_scales, inputs, inputs_scales, expert_offsets, window_begin)
    total = out + part if accumulate else part
    if rounded is not None:
        return rounded.copy_(total)
    return part if out is None else out.copy_(total)


def _sim_fp8_expert_wgrad_windowed(grad, grad_scales, inputs, inputs_scales, expert_offsets, window_begin, rounded, carry):
    """The windowed form (ops.fp8_expert_wgrad `carry`) as its docstring states it: each chain continues
    from carry_in when its segment began before the window and gets the window's blocks added in order
    (quantization.fp8_grouped_weight_grad: the same additions as one pass), then is rounded into
    `rounded` where the segment ends in the window (an empty expert: the window at row 0) or goes on
    into carry_out; experts without rows here are left alone."""
    carry_in, carry_out = carry
    rows, experts = grad.shape[1], expert_offsets.shape[0] - 1
    begin, end, bounds = window_begin, window_begin + rows, expert_offsets.tolist()
    chains = torch.zeros(experts + 1, grad.shape[0], inputs.shape[0])
    for e in range(experts):
        if bounds[e] < begin:
            chains[e] = carry_in
    local = (expert_offsets.long() - begin).clamp(0, rows)
    quantization.fp8_grouped_weight_grad(grad, grad_scales, inputs, inputs_scales, local, chains)
    for e in range(experts):
        o, o_next = bounds[e], bounds[e + 1]
        has_rows = max(o, begin) < min(o_next, end)
        if (o == o_next and begin == 0) or (has_rows and o_next <= end):
            rounded[e] = chains[e]
        elif has_rows:
            carry_out.copy_(chains[e])
    return rounded


def _meets_the_op_contract(check, *args) -> None:
    """Runs an op's argument check (megatron_mok/ops) on the stage's CPU arguments: every check but
    the device's must pass (the checks test the device last), so a dtype, shape, layout or
    contiguity the kernel would refuse fails here, on CPU, as it would on the GPU."""
    try:
        check(*args)
    except ValueError as error:
        if "must be a CUDA tensor" not in str(error):
            raise


def _sim_fp8_quantize_rows(x, row_index=None, *, source_scales=True, gemm_a_scales=True, pow2=False):
    _meets_the_op_contract(fp8_quant.check_fp8_quantize_rows_args, x, row_index, source_scales, gemm_a_scales, pow2)
    q, scales, gemm_a = ops.fp8_quantize_rows_reference(x, row_index, pow2)
    return q, scales if source_scales else None, gemm_a if gemm_a_scales else None


def _sim_fp8_quantize_columns(x, expert_offsets=None, *, pow2=False, row_index=None, row_weights=None):
    _meets_the_op_contract(fp8_quant.check_fp8_quantize_columns_args, x, expert_offsets, pow2, row_index, row_weights)
    if row_index is not None:  # only entries before the schedule's end are read (and must be in range)
        end = row_index.shape[0] if expert_offsets is None else int(expert_offsets[-1])
        assert bool(((row_index[:end] >= -1) & (row_index[:end] < x.shape[0])).all()), "row_index out of range"
    return ops.fp8_quantize_columns_reference(x, expert_offsets, pow2, row_index, row_weights)


def _sim_fp8_quantize_swiglu_columns(gate_up, expert_offsets, *, pow2=False):
    _meets_the_op_contract(fp8_quant.check_fp8_quantize_swiglu_args, gate_up, expert_offsets, pow2)
    return ops.fp8_quantize_swiglu_columns_reference(gate_up, expert_offsets, pow2)


def _sim_fp8_quantize_swiglu(gate_up, expert_offsets, *, pow2=False):
    _meets_the_op_contract(fp8_quant.check_fp8_quantize_swiglu_args, gate_up, expert_offsets, pow2)
    # (the rows at or past the end, NaN here, are never read: the reference zeroes their act)
    return ops.fp8_quantize_swiglu_reference(gate_up, expert_offsets, pow2)


def _sim_fp8_quantize_swiglu_backward(gate_up, grad_act, expert_offsets, *, pow2=False):
    _meets_the_op_contract(fp8_quant.check_fp8_quantize_swiglu_backward_args, gate_up, grad_act, expert_offsets, pow2)
    # (rows at or past the end, NaN here, are never read: the reference zeroes their d gate_up)
    return ops.fp8_quantize_swiglu_backward_reference(gate_up, grad_act, expert_offsets, pow2)


def _sim_fp8_quantize_swiglu_backward_copies(gate_up, grad_act, expert_offsets, *, pow2=False, act_columns=False):
    assert isinstance(act_columns, bool), act_columns
    _meets_the_op_contract(functools.partial(fp8_quant.check_fp8_quantize_swiglu_backward_args,
                                             op="fp8_quantize_swiglu_backward_copies"),
                           gate_up, grad_act, expert_offsets, pow2)
    # (rows at or past the end, NaN here, are never read: zero rows of every copy)
    return ops.fp8_quantize_swiglu_backward_copies_reference(gate_up, grad_act, expert_offsets, pow2, act_columns)


def _poison_experts_without_rows(copies, expert_offsets):
    """The weight copies with expert_offsets: the blocks of experts without rows there are left
    unwritten by the kernels; here NaN bytes and scales, so a GEMM that read one would show it."""
    if expert_offsets is None:
        return copies
    empty = expert_offsets[1:] == expert_offsets[:-1]
    poisoned = []
    for copy in copies:
        if copy is not None:
            copy = copy.clone()
            if copy.dtype == E4M3:
                copy.view(torch.uint8)[empty] = 0x7F  # E4M3 NaN
            else:
                copy[empty] = float("nan")
        poisoned.append(copy)
    return tuple(poisoned)


def _sim_fp8_quantize_weight(weight, *, transposed=True, pow2=False, forward_copy=True, expert_offsets=None):
    _meets_the_op_contract(fp8_quant.check_fp8_quantize_weight_args, weight, transposed, pow2, forward_copy,
                           expert_offsets)
    copies = ops.fp8_quantize_weight_reference(weight, pow2, transposed=transposed, forward_copy=forward_copy)
    return _poison_experts_without_rows(copies, expert_offsets)


def _sim_fp8_transpose_weight(q, scales, expert_offsets=None):
    _meets_the_op_contract(fp8_quant.check_fp8_transpose_weight_args, q, scales, expert_offsets)
    return _poison_experts_without_rows(ops.fp8_transpose_weight_reference(q, scales), expert_offsets)


SIMULATED = {
    "fp8_quantize_rows": _sim_fp8_quantize_rows,
    "fp8_quantize_swiglu": _sim_fp8_quantize_swiglu,
    "fp8_quantize_swiglu_columns": _sim_fp8_quantize_swiglu_columns,
    "fp8_quantize_swiglu_backward": _sim_fp8_quantize_swiglu_backward,
    "fp8_quantize_swiglu_backward_copies": _sim_fp8_quantize_swiglu_backward_copies,
    "fp8_quantize_weight": _sim_fp8_quantize_weight,
    "fp8_transpose_weight": _sim_fp8_transpose_weight,
    "fp8_quantize_columns": _sim_fp8_quantize_columns,
    "dispatch_rows": _sim_dispatch_rows,
    "pull_grad_rows": _sim_pull_grad_rows,
    "fp8_expert_gemm": _sim_fp8_expert_gemm,
    "fp8_expert_gemm_swiglu": _sim_fp8_expert_gemm_swiglu,
    "fp8_expert_gemm_swiglu_backward": _sim_fp8_expert_gemm_swiglu_backward,
    "fp8_expert_wgrad": _sim_fp8_expert_wgrad,
    "swiglu_forward": lambda gate_up, offsets: _zero_past_end(reference.swiglu(gate_up), offsets),
    "swiglu_backward": lambda gate_up, grad_act, offsets: _zero_past_end(reference.swiglu_backward(gate_up, grad_act), offsets),
    "combine": lambda table, index, weights, topk: reference.combine(table, index, weights, topk, table.dtype),
    "combine_keeping": lambda table, index, weights, topk, keep: reference.combine(table, index, weights, topk, table.dtype, keep),
    "route_weight_grads": reference.route_weight_grads,
    # The BF16 sm90 weight gradient (fp8_weight_grad=False) reads only the segments' rows.
    "expert_gemm_wgrad": lambda g, x, offsets: reference.segment_weight_grad(_zero_past_end(g, offsets), _zero_past_end(x, offsets), offsets),
}


@pytest.fixture
def simulated_kernels(monkeypatch):
    """The kernel backend on CPU: every op its reference, the backend forced."""
    for name, sim in SIMULATED.items():
        monkeypatch.setattr(ops, name, sim)
    monkeypatch.setattr(functional, "resolve_backend", lambda backend, x, fc1, precision="bf16": backend)


def _configs(weight_grad=True, pow2=False):
    common = dict(precision="fp8_blockwise", fp8_weight_grad=weight_grad, fp8_pow2_scales=pow2)
    # (expert_gemm "sm90": the BF16 weight gradients of fp8_weight_grad=False are the sm90 kernel's.)
    return MoKConfig(backend="kernel", expert_gemm="sm90", **common), MoKConfig(backend="reference", **common)


NAMES = ("y", "dx", "dtopk_weights", "dfc1", "dfc2")


def _assert_equal(got, want, what):
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), f"{what}: {name} differs from the reference backend's FP8"


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_fp8_stages_equal_the_reference_backend(simulated_kernels, shape, routing):
    problem = make_problem(SHAPES[shape], routing, torch.bfloat16, seed=zlib.crc32(f"{shape}/{routing}".encode()))
    kernel_config, reference_config = _configs()
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), f"{shape}/{routing}")


def test_kernel_fp8_stages_without_tokens_equal_the_reference_backend(simulated_kernels):
    """A rank with no tokens (T = 0): every segment is padding (128-row alignment), nothing is read."""
    problem = make_problem(Shape(0, 128, 256, 3, 2), "uniform", torch.bfloat16, seed=1)
    kernel_config, reference_config = _configs()
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), "no tokens")


@pytest.mark.parametrize("weight_grad,pow2", [(False, False), (True, True)], ids=["bf16_weight_grads", "pow2_scales"])
def test_kernel_fp8_options_equal_the_reference_backend(simulated_kernels, weight_grad, pow2):
    problem = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=5)
    kernel_config, reference_config = _configs(weight_grad, pow2)
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), "options")


@pytest.mark.parametrize("choice", tuning.FP8_ACT_QUANTIZE_CHOICES)
def test_kernel_fp8_act_quantized_either_way_equals_the_reference_backend(simulated_kernels, monkeypatch, choice):
    """tuning.FP8_ACT_QUANTIZE: act quantized by the gate/up GEMM's epilogue or by the SwiGLU
    quantization kernel after it, the layer bitwise the reference backend's either way."""
    monkeypatch.setattr(tuning, "FP8_ACT_QUANTIZE", choice)
    called = []
    for name in ("fp8_expert_gemm_swiglu", "fp8_quantize_swiglu"):  # which op made act
        monkeypatch.setattr(ops, name, lambda *a, sim=SIMULATED[name], name=name, **k: called.append(name) or sim(*a, **k))
    problem = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=7)
    kernel_config, reference_config = _configs()
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), choice)
    wanted = "fp8_expert_gemm_swiglu" if choice == "gemm_epilogue" else "fp8_quantize_swiglu"
    assert called and set(called) == {wanted}, f"{choice}: act made by {called}"


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_kernel_fp8_gemms_launch_at_tunings_cluster_size_read_at_the_call(simulated_kernels, monkeypatch, cluster_m):
    """tuning.FP8_EXPERT_GEMM_CLUSTER_M and _GROUP_M as they are when the layer runs (not when
    kernel_fp8 was imported) reach every FP8 GEMM launch, forward and backward: what bench_layer.py's
    cluster row sets. The layer stays bitwise the reference backend's."""
    monkeypatch.setattr(tuning, "FP8_EXPERT_GEMM_CLUSTER_M", cluster_m)
    monkeypatch.setattr(tuning, "FP8_EXPERT_GEMM_GROUP_M", 8)
    launches = []

    def recording(name, sim):
        def op(*args, **kwargs):
            launches.append((name, kwargs.get("cluster_m", args[5] if len(args) > 5 else None),
                             kwargs.get("group_m", args[6] if len(args) > 6 else None)))
            return sim(*args, **kwargs)
        return op

    for name in ("fp8_expert_gemm", "fp8_expert_gemm_swiglu", "fp8_expert_gemm_swiglu_backward"):
        monkeypatch.setattr(ops, name, recording(name, SIMULATED[name]))
    problem = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=9)
    kernel_config, reference_config = _configs()
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), "cluster")
    assert len(launches) >= 4, launches  # fc1, fc2 and the two dgrads at least
    assert all(launch[1:] == (cluster_m, 8) for launch in launches), launches


def test_kernel_fp8_refuses_an_unknown_act_quantize_choice(simulated_kernels, monkeypatch):
    monkeypatch.setattr(tuning, "FP8_ACT_QUANTIZE", "epilogue")
    problem = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=8)
    with pytest.raises(ValueError, match="FP8_ACT_QUANTIZE must be one of"):
        run_layer(*problem, config=_configs()[0])


def test_kernel_fp8_without_the_weight_cache_caches_nothing_and_equals_the_reference(simulated_kernels):
    """fp8_cache_weights=False on the kernel backend: the layer is bitwise the reference backend's, and
    no weight copy is left cached while the weights live."""
    x, ids, weights, fc1, fc2, grad = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=6)
    kernel_config, reference_config = (dataclasses.replace(c, fp8_cache_weights=False) for c in _configs())
    fp8_weights.clear()
    leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]
    y = mok_moe(leaves[0], ids, *leaves[1:], config=kernel_config)
    y.backward(grad)
    assert fp8_weights.cached_count() == 0, "the uncached kernel layer cached a weight"
    got = [y.detach()] + [leaf.grad for leaf in leaves]
    _assert_equal(got, run_layer(x, ids, weights, fc1, fc2, grad, config=reference_config), "uncached")


@pytest.mark.parametrize("swiglu_backward_in_dgrad", [False, True], ids=["swiglu_backward_kernel", "in_dgrad"])
def test_kept_transposed_copies_are_made_with_the_forward_copies_and_reused(simulated_kernels, monkeypatch,
                                                                            swiglu_backward_in_dgrad):
    """fp8_cache_transposed_weights: each weight's forward and transposed copies come from one
    quantization call (transposed=True) in the first forward; each dgrad is one GEMM over the kept
    copy of every expert (no range copies); a second forward and backward with the same weights makes
    no copy at all; a weight updated in place gets both copies again. The layer is bitwise the
    reference backend's every time."""
    monkeypatch.setattr(tuning, "FP8_SWIGLU_BACKWARD_IN_DGRAD", swiglu_backward_in_dgrad)
    monkeypatch.setattr(tuning, "FP8_DGRAD_EXPERT_RANGES", 3)  # (ranges would show as several launches)
    calls = []

    def recording(name):
        def op(*args, **kwargs):
            if name == "fp8_quantize_weight":
                calls.append((name, kwargs.get("transposed", True), kwargs.get("forward_copy", True)))
            elif name == "fp8_transpose_weight":
                calls.append((name,))
            else:  # a GEMM: the experts of the weight copy it multiplies by
                calls.append((name, args[2].shape[0]))
            return SIMULATED[name](*args, **kwargs)
        return op

    for name in ("fp8_quantize_weight", "fp8_transpose_weight", "fp8_expert_gemm", "fp8_expert_gemm_swiglu",
                 "fp8_expert_gemm_swiglu_backward"):
        monkeypatch.setattr(ops, name, recording(name))
    x, ids, weights, fc1, fc2, grad = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=12)
    experts = fc1.shape[0]
    kernel_config, reference_config = (dataclasses.replace(c, fp8_cache_transposed_weights=True) for c in _configs())
    fp8_weights.clear()
    leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]

    def step():
        for leaf in leaves:
            leaf.grad = None
        calls.clear()
        y = mok_moe(leaves[0], ids, *leaves[1:], config=kernel_config)
        y.backward(grad)
        got = [y.detach()] + [leaf.grad for leaf in leaves]
        _assert_equal(got, run_layer(x, ids, weights, leaves[2].detach(), leaves[3].detach(), grad,
                                     config=reference_config), "kept transposed copies")
        return list(calls)

    first = step()
    assert [c for c in first if c[0].startswith("fp8_quantize") or c[0] == "fp8_transpose_weight"] == [
        ("fp8_quantize_weight", True, True)] * 2, first
    gemms = [c for c in first if c[0].startswith("fp8_expert_gemm")]
    assert len(gemms) == 4 and all(c[1] == experts for c in gemms), gemms  # fc1, fc2, two one-launch dgrads
    again = step()
    assert not [c for c in again if not c[0].startswith("fp8_expert_gemm")], again
    assert len([c for c in again if c[0].startswith("fp8_expert_gemm")]) == 4, again
    with torch.no_grad():
        leaves[2].mul_(0.5)  # (an in-place update: the version counter moves)
    updated = step()
    assert [c for c in updated if c[0] == "fp8_quantize_weight"] == [("fp8_quantize_weight", True, True)], updated
    assert not [c for c in updated if c[0] == "fp8_transpose_weight"], updated


def test_kept_transposed_copies_are_not_kept_where_nothing_is_cacheable(simulated_kernels, monkeypatch):
    """Where nothing is cacheable (here an inference-mode weight, as in a CUDA-graph capture)
    kept_transposed gives None and the dgrads make their range copies as without the option; so it
    does for a weight with no cached forward copy (it never quantizes: a backward caches nothing of
    its own). Over a forward copy cached without its transposed one, it makes that from the forward
    copy and keeps it."""
    with torch.inference_mode():
        weight = torch.randn(2, 256, 128).bfloat16()
    assert fp8_weights.kept_transposed(weight) is None
    weight = torch.randn(2, 256, 128).bfloat16()
    want = ops.fp8_quantize_weight_reference(weight, False, transposed=True)
    for keep_transposed in (True, False):
        fp8_weights.clear()
        assert fp8_weights.kept_transposed(weight) is None and fp8_weights.cached_count() == 0
        fp8_weights.quantized(weight, kernels=True, keep_transposed=keep_transposed)
        kept = fp8_weights.kept_transposed(weight)
        assert kept is fp8_weights.kept_transposed(weight), "a second call must hand the kept copy"
        assert torch.equal(kept.values.view(torch.uint8), want[2].view(torch.uint8))
        assert torch.equal(kept.scales, want[3])


def _cached_copy_bytes() -> int:
    """The bytes of every copy the weight cache holds now (forward and kept transposed)."""
    total = 0
    with fp8_weights._LOCK:
        for entries in list(fp8_weights._CACHE.values()):
            for entry in entries.values():
                for copy in (entry.weight, entry.transposed):
                    if copy is not None:
                        total += copy.values.numel() * copy.values.element_size() + copy.scales.numel() * 4
    return total


@pytest.mark.parametrize("kept", [False, True], ids=["default", "kept_transposed"])
@pytest.mark.parametrize("route", ["checkpoint", "checkpoint_reentrant", "copying_hook"])
def test_weights_reaching_backward_as_other_tensors(simulated_kernels, monkeypatch, route, kept):
    """fc1 and fc2 can reach backward as other tensor objects than the forward's: the detached alias
    non-reentrant checkpointing hands back, the detached inputs of a reentrant recompute, or a copy
    (an offloading saved-tensor hook). The layer stays bitwise a plain call's; an alias finds the
    copies its forward cached (a later call quantizes nothing), a copy makes its dgrads' range
    copies; and during backward the cache never holds more than the bound counts: the forward copies,
    and with fp8_cache_transposed_weights their kept transposed copies (no copies cached for the
    alias or the copy, which would outlive nothing but still count)."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(tuning, "FP8_DGRAD_EXPERT_RANGES", 4)
    shape = Shape(64, 256, 128, 8, 2)  # T, H, F, E, K
    x, ids, weights, fc1, fc2, grad = make_problem(shape, "uniform", torch.bfloat16, seed=5)
    config = dataclasses.replace(_configs()[0], fp8_cache_transposed_weights=kept)
    forward_copies = weight_copy_bytes(8, 256, 256) + weight_copy_bytes(8, 256, 128)
    bound = forward_copies * (2 if kept else 1)
    peak, weight_quantizations = [0], []
    for name in ("fp8_expert_gemm", "fp8_expert_gemm_swiglu_backward"):
        simulated = SIMULATED[name]
        monkeypatch.setattr(ops, name, lambda *a, _op=simulated, **k: (
            peak.__setitem__(0, max(peak[0], _cached_copy_bytes())), _op(*a, **k))[1])
    quantize = SIMULATED["fp8_quantize_weight"]
    monkeypatch.setattr(ops, "fp8_quantize_weight", lambda *a, **k: (
        weight_quantizations.append(k.get("forward_copy", True)), quantize(*a, **k))[1])

    def layer(x_leaf, a, b):
        return mok_moe(x_leaf, ids, weights, a, b, config=config)

    def run(how):
        fp8_weights.clear()
        params = [torch.nn.Parameter(w.clone()) for w in (fc1, fc2)]
        results = []
        for _ in range(2):
            peak[0] = 0
            weight_quantizations.clear()
            x_leaf = x.clone().requires_grad_()
            if how == "plain":
                y = layer(x_leaf, *params)
            elif how == "copying_hook":
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
                    y = layer(x_leaf, *params)
            else:
                y = checkpoint(layer, x_leaf, *params, use_reentrant=how == "checkpoint_reentrant")
            y.backward(grad)
            results.append(([y.detach(), x_leaf.grad] + [p.grad for p in params], list(weight_quantizations), peak[0]))
            for p in params:
                p.grad = None
        return results

    for (want, _, _), (got, quantizations, cache_peak) in zip(run("plain"), run(route)):
        _assert_equal(got, want, route)
        assert cache_peak <= bound, f"{route}: the cache held {cache_peak} B in backward, the bound counts {bound}"
    if route != "copying_hook":
        assert quantizations == [], f"{route}: a later call quantized {quantizations} (its alias missed the cache)"
    else:  # the copies' dgrads: transposed range copies only, no forward copy made again
        assert quantizations and not any(quantizations), quantizations


def test_an_alias_never_reads_copies_its_weight_would_not(simulated_kernels):
    """A `.data` view taken before an in-place update keeps version 0 while the weight's counter
    moves on: it must quantize the bytes as they are now, not read the copies made before."""
    weight = torch.nn.Parameter(torch.randn(2, 256, 128).bfloat16())
    fp8_weights.clear()
    old_view = weight.data
    before = fp8_weights.quantized(weight, kernels=True)
    assert fp8_weights.quantized(weight.detach(), kernels=True) is before, "a detached alias reads the copy"
    with torch.no_grad():
        weight.mul_(0.5)
    got = fp8_weights.quantized(old_view, kernels=True)
    want = ops.fp8_quantize_weight_reference(old_view, False, transposed=False)
    assert got is not before
    assert torch.equal(got.values.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got.scales, want[1])


def test_aliases_of_weights_that_are_views_into_one_buffer_find_their_own_copies(simulated_kernels):
    """Megatron's contiguous parameter buffer makes every weight a view into one storage: each
    weight's detached alias finds its own weight's copies, never another view's."""
    buffer = torch.randn(2 * 2 * 256 * 128).bfloat16()
    fc1 = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
    fc2 = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
    fc1.data, fc2.data = buffer[: buffer.numel() // 2].view(2, 256, 128), buffer[buffer.numel() // 2 :].view(2, 256, 128)
    fp8_weights.clear()
    copies = [fp8_weights.quantized(w, kernels=True) for w in (fc1, fc2)]
    for weight, copy in zip((fc1, fc2), copies):
        assert fp8_weights.quantized(weight.detach(), kernels=True) is copy
    assert fp8_weights.cached_count() == 2


def test_an_alias_that_misses_leaves_its_weight_findable_and_stale_copies_go(simulated_kernels):
    """An alias that misses (another pow2 choice here) caches copies of its own without taking the
    weight's place from it: once the alias is gone, the weight's next aliases still find the weight's
    copies. And a weight whose copies went stale loses them at its next look-up, even where an alias's
    newer copies answer for it, so one weight never holds two entries."""
    import gc

    weight = torch.nn.Parameter(torch.randn(2, 256, 128).bfloat16())
    fp8_weights.clear()
    copy = fp8_weights.quantized(weight, kernels=True)
    alias = weight.detach()
    fp8_weights.quantized(alias, pow2=True, kernels=True)
    del alias
    gc.collect()
    assert all(fp8_weights.quantized(weight.detach(), kernels=True) is copy for _ in range(3))

    with torch.no_grad():
        weight.mul_(2)  # (the alias below shares the counter: both see the update)
    alias = weight.detach()
    fresh = fp8_weights.quantized(alias, kernels=True)
    assert fp8_weights.quantized(weight, kernels=True) is fresh
    with fp8_weights._LOCK:
        own = fp8_weights._CACHE.get(weight, {})
        assert (False, True) not in own, "the weight's stale copies stayed in the cache"


@pytest.mark.parametrize("kept", [False, True], ids=["default", "kept_transposed"])
def test_a_stale_entry_goes_before_its_weight_is_quantized_again(simulated_kernels, monkeypatch, kept):
    """After an in-place update the next call quantizes again; the stale copies leave the cache before
    the new ones are made, so the cache plus the copies being made never exceed one set per weight."""
    x, ids, weights, fc1, fc2, grad = make_problem(Shape(64, 256, 128, 8, 2), "uniform", torch.bfloat16, seed=5)
    config = dataclasses.replace(_configs()[0], fp8_cache_transposed_weights=kept)
    params = [torch.nn.Parameter(w.clone()) for w in (fc1, fc2)]
    fp8_weights.clear()
    peak = [0]
    quantize = SIMULATED["fp8_quantize_weight"]

    def recording(*args, **kwargs):
        made = quantize(*args, **kwargs)
        new_bytes = sum(t.numel() * t.element_size() for t in made if t is not None)
        peak[0] = max(peak[0], _cached_copy_bytes() + new_bytes)
        return made

    monkeypatch.setattr(ops, "fp8_quantize_weight", recording)
    mok_moe(x, ids, weights, *params, config=config).backward(grad)
    with torch.no_grad():
        for p in params:
            p.add_(0.01)
    peak[0] = 0
    mok_moe(x, ids, weights, *params, config=config).backward(grad)
    held = (weight_copy_bytes(8, 256, 256) + weight_copy_bytes(8, 256, 128)) * (2 if kept else 1)
    assert 0 < peak[0] <= held, (peak[0], held)


@pytest.mark.parametrize("routing", ("uniform", "all_to_last_rank", "dropped"))
def test_kernel_fp8_emulated_ranks_equal_ep1_bitwise(simulated_kernels, routing):
    num_ranks, t, h, f, e, k = 2, 9, 128, 128, 2, 3
    problem = make_ranks_problem(num_ranks, t, h, f, e, k, routing, "cpu", torch.bfloat16, zlib.crc32(f"fp8k/{routing}".encode()))
    config, _ = _configs()
    got = run_emulated(EmulatedGroup(num_ranks, "cpu"), problem, e, config)
    assert_bitwise(got, run_concatenated(problem, config), f"fp8 kernel stages r2/{routing}")


@pytest.mark.parametrize("routing", ["uniform", "all_to_last_rank"])
def test_kept_transposed_copies_over_windows_equal_ep1_bitwise(simulated_kernels, monkeypatch, routing):
    """fp8_cache_transposed_weights over emulated ranks and several receive windows: every window's
    dgrads take the kept copy (one launch each over every expert, the window's segments), no range copy
    is made, and the outputs and gradients are bitwise EP = 1's without the option."""
    from megatron_mok.comm.exchange import CollectiveExchange

    num_ranks, t, h, f, e, k = 4, 64, 128, 128, 2, 4
    problem = make_ranks_problem(num_ranks, t, h, f, e, k, routing, "cpu", torch.bfloat16, 29)
    want = run_concatenated(problem, _configs()[0])
    monkeypatch.setattr(CollectiveExchange, "windowed", True)
    kept = dataclasses.replace(_configs()[0], receive_capacity_factor=0.3, fp8_cache_transposed_weights=True)
    group = EmulatedGroup(num_ranks, "cpu")
    assert functional.plan_for(CollectiveExchange(group.ranks[0]), t, k, e, kept).num_windows > 2
    range_copies = []
    original = fp8_weights.transposed_experts
    monkeypatch.setattr(fp8_weights, "transposed_experts", lambda *a, **kw: range_copies.append(1) or original(*a, **kw))
    fp8_weights.clear()
    assert_bitwise(run_emulated(group, problem, e, kept), want, f"kept transposed copies over windows/{routing}")
    assert not range_copies, "a dgrad made a range copy with the transposed copies kept"
    fp8_weights.clear()


def test_the_fp8_kernel_table_and_the_backend_choice():
    table = stages_for("kernel", "auto", Fp8Recipe())
    assert table.weight_grad_family == "fp8_kernel" and table.weight_grad_window is not None
    assert stages_for("kernel", "sm90", Fp8Recipe(weight_grad=False)).weight_grad_family == "sm90"
    x, ids, weights, fc1, fc2, _ = make_problem(SHAPES["odd_t"], "uniform", torch.bfloat16)
    assert resolve_backend("auto", x, fc1, "fp8_blockwise") == "reference"  # (CPU tensors)
    # (On CPU the kernels need CUDA tensors: named as for bf16.)
    with pytest.raises(ValueError, match="the kernel needs CUDA tensors"):
        resolve_backend("kernel", x, fc1, "fp8_blockwise")


@pytest.mark.parametrize("window_rows", [128, 256, 384])
def test_kernel_fp8_weight_grads_over_windows_equal_one_window_bitwise(simulated_kernels, window_rows):
    """kernel_fp8.weight_grad_window over several receive windows (the windowed form: two carries used
    in turn, the bf16 result filled as experts end, what is handed between windows a
    WindowedWeightGrad) gives the one-window gradient bit for bit, for segments crossing one and
    several window edges, empty experts at either end and rows past the schedule's end."""
    from types import SimpleNamespace

    from megatron_mok.receive import Window

    counts, m, n = [0, 300, 0, 129, 700, 0], 256, 128
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + -(-count // 128) * 128)
    capacity = -(-(bounds[-1] + 128) // window_rows) * window_rows  # rows past the end, whole windows
    full = torch.tensor(bounds, dtype=torch.int32)
    gen = torch.Generator().manual_seed(window_rows)
    routed = torch.zeros(capacity, 1, dtype=torch.bool)
    for e, count in enumerate(counts):
        routed[bounds[e]:bounds[e] + count] = True
    grad_out = torch.where(routed, torch.randn(capacity, m, generator=gen), 0.0).bfloat16()
    inputs = torch.where(routed, torch.randn(capacity, n, generator=gen), 0.0).bfloat16()
    recipe = Fp8Recipe()

    def window(index, count, begin, rows):
        local = (full - begin).clamp(0, rows).to(torch.int32)
        return Window(index, count, begin, SimpleNamespace(expert_offsets=local), full)

    one = kernel_fp8.weight_grad_window(grad_out, inputs, window(0, 1, 0, capacity), None, recipe=recipe)
    count = capacity // window_rows
    carried = None
    for w in range(count):
        begin = w * window_rows
        rows = slice(begin, begin + window_rows)
        carried = kernel_fp8.weight_grad_window(grad_out[rows], inputs[rows], window(w, count, begin, window_rows),
                                                carried, recipe=recipe)
        assert isinstance(carried, torch.Tensor) == (w == count - 1)
    assert count > 2
    assert torch.equal(carried.view(torch.int16), one.view(torch.int16))


@pytest.mark.parametrize("in_dgrad", [True, False])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_the_swiglu_backward_quantizes_d_gate_ups_rows_in_its_pass(simulated_kernels, monkeypatch, weight_grad,
                                                                   in_dgrad):
    """With FP8 weight gradients the SwiGLU backward quantizes d gate_up for the gate/up dgrad as it
    writes it: in the down dgrad's epilogue (ops.fp8_expert_gemm_swiglu_backward, with
    tuning.FP8_SWIGLU_BACKWARD_IN_DGRAD) or in a pass of its own after that dgrad
    (ops.fp8_quantize_swiglu_backward, without); neither swiglu_backward nor a row quantization of d
    gate_up runs. With BF16 weight gradients swiglu_backward makes the bf16 d gate_up the BF16 weight
    gradient reads, and the dgrad quantizes it. The layer bitwise the reference's every way."""
    called = []
    monkeypatch.setattr(tuning, "FP8_SWIGLU_BACKWARD_IN_DGRAD", in_dgrad)

    def record(name, sim):
        def op(*args, **kwargs):
            # (a row quantization for a GEMM's left operand: d gate_up's; the source rows' have no GEMM-A scales)
            called.append("d gate_up rows" if name == "fp8_quantize_rows" and kwargs.get("gemm_a_scales") else name)
            return sim(*args, **kwargs)
        return op

    names = ("swiglu_backward", "fp8_quantize_swiglu_backward", "fp8_expert_gemm_swiglu_backward", "fp8_quantize_rows")
    for name in names:
        monkeypatch.setattr(ops, name, record(name, SIMULATED[name]))
    problem = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=9)
    kernel_config, reference_config = _configs(weight_grad=weight_grad)
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), "d gate_up")
    if not weight_grad:
        wanted = {"swiglu_backward", "d gate_up rows"}
    else:
        wanted = {"fp8_expert_gemm_swiglu_backward" if in_dgrad else "fp8_quantize_swiglu_backward"}
    unwanted = {*names, "d gate_up rows"} - wanted - {"fp8_quantize_rows"}
    assert wanted <= set(called) and not unwanted & set(called), f"weight_grad={weight_grad}: {called}"


def test_the_stage_table_follows_the_tuning_settings_that_pick_its_stages(monkeypatch):
    """kernel_fp8_stages is made once per recipe and per value of the tuning settings that pick its
    stages (tuning.FP8_PUSH_IN_EPILOGUE, the one-pass act columns), so a setting changed between two
    calls in one process (as the benchmarks change them) takes effect at the next call."""
    recipe = Fp8Recipe()
    monkeypatch.setattr(tuning, "FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS", True)
    for push in (True, False, True):
        monkeypatch.setattr(tuning, "FP8_PUSH_IN_EPILOGUE", push)
        stages = kernel_fp8.kernel_fp8_stages(recipe)
        assert (stages.expert_down_pushed is not None) == push and (stages.dgrad_rows_pushed is not None) == push
    for act in (False, True, False):
        monkeypatch.setattr(tuning, "FP8_ACT_COLUMNS_IN_ONE_PASS", act)
        assert (kernel_fp8.kernel_fp8_stages(recipe).dgrad_swiglu_and_act is not None) == act
    monkeypatch.setattr(tuning, "FP8_ACT_COLUMNS_IN_ONE_PASS", True)
    monkeypatch.setattr(tuning, "FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS", False)  # (act's pass is that pass)
    assert kernel_fp8.kernel_fp8_stages(recipe).dgrad_swiglu_and_act is None


@pytest.mark.parametrize("act_in_pass", [False, True], ids=["act_apart", "act_in_pass"])
@pytest.mark.parametrize("routing", ("skewed", "one_expert", "dropped"))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_d_gate_ups_copies_from_one_pass_equal_the_reference(simulated_kernels, monkeypatch, shape, routing,
                                                             act_in_pass):
    """tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS: both FP8 copies of d gate_up come from one op
    (ops.fp8_quantize_swiglu_backward_copies); neither the row-wise SwiGLU backward op nor a column
    quantization of a bf16 d gate_up runs, and no bf16 d gate_up exists between the stages. With
    tuning.FP8_ACT_COLUMNS_IN_ONE_PASS act's column copy comes from that op too (act_columns), and
    ops.fp8_quantize_swiglu_columns does not run; without it, it does. The layer is bitwise the
    reference backend's."""
    monkeypatch.setattr(tuning, "FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS", True)
    monkeypatch.setattr(tuning, "FP8_ACT_COLUMNS_IN_ONE_PASS", act_in_pass)
    called, column_sources = [], []

    def record(name, sim):
        def op(*args, **kwargs):
            called.append(name + (" with act" if kwargs.get("act_columns") else ""))
            if name == "fp8_quantize_columns" and kwargs.get("row_index") is None:
                column_sources.append(tuple(args[0].shape))  # (x's and w * dY's are gathered from their rows)
            return sim(*args, **kwargs)
        return op

    names = ("swiglu_backward", "fp8_quantize_swiglu_backward", "fp8_quantize_swiglu_backward_copies",
             "fp8_quantize_columns", "fp8_quantize_swiglu_columns", "swiglu_forward")
    for name in names:
        monkeypatch.setattr(ops, name, record(name, SIMULATED[name]))
    problem = make_problem(SHAPES[shape], routing, torch.bfloat16, seed=zlib.crc32(f"copies/{shape}/{routing}".encode()))
    kernel_config, reference_config = _configs()
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config),
                  f"one-pass copies {shape}/{routing}")
    copies = "fp8_quantize_swiglu_backward_copies" + (" with act" if act_in_pass else "")
    assert copies in called and ("fp8_quantize_swiglu_columns" in called) != act_in_pass, called
    assert not {"fp8_quantize_swiglu_backward", "swiglu_backward", "swiglu_forward"} & set(called), called
    assert not column_sources, f"a column quantization of rows in memory (d gate_up's): {column_sources}"


@pytest.mark.parametrize("act_in_pass", [False, True], ids=["act_apart", "act_in_pass"])
def test_d_gate_ups_copies_from_one_pass_over_windows_equal_ep1_bitwise(simulated_kernels, monkeypatch, act_in_pass):
    """The one-pass copies (and act's column copy with them) over emulated ranks and several receive
    windows (each window's d gate_up its own pass, gate/up made again in backward for the windows after
    the first): bitwise EP = 1's with the separate launches."""
    from megatron_mok.comm.exchange import CollectiveExchange

    num_ranks, t, h, f, e, k = 4, 64, 128, 128, 2, 4
    problem = make_ranks_problem(num_ranks, t, h, f, e, k, "uniform", "cpu", torch.bfloat16, 31)
    want = run_concatenated(problem, _configs()[0])
    monkeypatch.setattr(tuning, "FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS", True)
    monkeypatch.setattr(tuning, "FP8_ACT_COLUMNS_IN_ONE_PASS", act_in_pass)
    monkeypatch.setattr(CollectiveExchange, "windowed", True)
    windowed = dataclasses.replace(_configs()[0], receive_capacity_factor=0.3)
    group = EmulatedGroup(num_ranks, "cpu")
    assert functional.plan_for(CollectiveExchange(group.ranks[0]), t, k, e, windowed).num_windows > 2
    passes, act_apart = [], []
    monkeypatch.setattr(ops, "fp8_quantize_swiglu_backward_copies", lambda *a, **kw: passes.append(
        kw.get("act_columns", False)) or SIMULATED["fp8_quantize_swiglu_backward_copies"](*a, **kw))
    monkeypatch.setattr(ops, "fp8_quantize_swiglu_columns", lambda *a, **kw: act_apart.append(1) or
                        SIMULATED["fp8_quantize_swiglu_columns"](*a, **kw))
    assert_bitwise(run_emulated(group, problem, e, windowed), want, "one-pass copies over windows")
    assert len(passes) > num_ranks, "the windows did not make their d gate_up copies in one pass each"
    assert set(passes) == {act_in_pass} and bool(act_apart) != act_in_pass, (passes, len(act_apart))


@pytest.mark.parametrize("ranges", [1, 2, 3, 4, 9])
def test_one_window_dgrads_hold_one_expert_range_of_the_transposed_copy_at_a_time(simulated_kernels, monkeypatch,
                                                                                   ranges):
    """A one-window backward multiplies each dgrad expert range by expert range (tuning.
    FP8_DGRAD_EXPERT_RANGES): the ranges' transposed copies tile the experts in order, each of
    ceil(E / ranges) experts at most, and each is freed before the next range's is made; the layer is
    bitwise the reference backend's whatever the number of ranges (4 experts here: 1 range is the whole
    copy, 9 is one expert per range)."""
    import weakref

    made, alive_at_make = [], []
    original = fp8_weights.transposed_experts

    def transposed_experts(weight, first, end, *args, **kwargs):
        alive_at_make.append(sum(ref() is not None for ref in made))
        copy = original(weight, first, end, *args, **kwargs)
        made.append(weakref.ref(copy.values))
        ranges_seen.append((tuple(weight.shape), first, end))
        return copy

    ranges_seen = []
    monkeypatch.setattr(tuning, "FP8_DGRAD_EXPERT_RANGES", ranges)
    monkeypatch.setattr(fp8_weights, "transposed_experts", transposed_experts)
    problem = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=11)
    kernel_config, reference_config = _configs()
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), "ranges")
    experts = SHAPES["small"].num_experts
    span = -(-experts // ranges)
    if span >= experts:  # one range: each weight's whole copy, made once
        assert sorted((first, end) for _, first, end in ranges_seen) == [(0, experts)] * 2, ranges_seen
        return
    for shape in {n for n, _, _ in ranges_seen}:  # each weight's dgrad (fc1 (E, 2F, H), fc2 (E, H, F))
        bounds = [(first, end) for n, first, end in ranges_seen if n == shape]
        assert bounds == [(e, min(experts, e + span)) for e in range(0, experts, span)], bounds
    assert len({n for n, _, _ in ranges_seen}) == 2
    assert max(alive_at_make) == 0, "a range's transposed copy was alive when the next was made"


def test_d_gate_up_lives_as_its_two_fp8_copies_and_the_dgrad_takes_the_row_wise_one(simulated_kernels, monkeypatch):
    """With FP8 weight gradients d gate_up is held between the stages as its two FP8 copies only (no
    bf16 values: GradGateUp), and the gate/up dgrad takes the row-wise copy (GradGateUp.take_rows), so
    that it is gone when the fc1 weight gradient runs on the column-wise copy. A second take is an
    error."""
    made, checked = [], []
    original_init, original_wgrad = kernel_fp8.GradGateUp.__init__, ops.fp8_expert_wgrad

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        made.append(self)

    def wgrad(grad, *args, **kwargs):
        for grad_gate_up in made:
            if grad is grad_gate_up.columns[0]:  # the fc1 weight gradient of that d gate_up
                checked.append(grad_gate_up)
                with pytest.raises(RuntimeError, match="already taken"):
                    grad_gate_up.take_rows()
        return original_wgrad(grad, *args, **kwargs)

    monkeypatch.setattr(kernel_fp8.GradGateUp, "__init__", init)
    monkeypatch.setattr(ops, "fp8_expert_wgrad", wgrad)
    problem = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=10)
    kernel_config, reference_config = _configs()
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), "copies")
    assert made and len(checked) == len(made)
    for grad_gate_up in made:
        held = [t for t in vars(grad_gate_up).values() if isinstance(t, torch.Tensor)]
        held += [t for t in grad_gate_up.columns]
        assert all(t.dtype in (E4M3, torch.float32) for t in held), [t.dtype for t in held]


@pytest.mark.parametrize("weight_grad", [True, False])
def test_the_fc2_weight_gradient_quantizes_act_straight_from_gate_up(simulated_kernels, monkeypatch, weight_grad):
    """With FP8 weight gradients backward makes no bf16 act: the fc2 weight gradient's act operand is
    quantized from gate_up (ops.fp8_quantize_swiglu_columns) and swiglu_forward never runs; with BF16
    weight gradients act is made by swiglu_forward as without FP8. The layer bitwise the reference's."""
    called = []
    for name in ("swiglu_forward", "fp8_quantize_swiglu_columns"):
        monkeypatch.setattr(ops, name, lambda *a, sim=SIMULATED[name], name=name, **k: called.append(name) or sim(*a, **k))
    problem = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=8)
    kernel_config, reference_config = _configs(weight_grad=weight_grad)
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), "act")
    wanted = "fp8_quantize_swiglu_columns" if weight_grad else "swiglu_forward"
    assert called and set(called) == {wanted}, f"weight_grad={weight_grad}: act made by {called}"


@pytest.mark.parametrize("cache_weights", [True, False])
@pytest.mark.parametrize("routing", ["skewed", "uniform", "all_to_last_rank"])
def test_backward_makes_gate_up_again_without_act_over_windows(simulated_kernels, monkeypatch, routing, cache_weights):
    """Over several receive windows backward makes each later window's gate/up again
    (kernel_fp8.recompute_gate_up): the GEMM alone, so the act quantization runs once per forward
    window and never in backward (backward's act is quantized from gate_up where the fc2 weight
    gradient needs it); every output and gradient bitwise the one-window pass. Without the weight
    cache a recomputed window's fc1 copy holds its experts with rows alone (the simulation leaves NaN
    in the others' blocks, so a GEMM reading one shows): routings whose later windows hold rows
    (uniform: every window; all_to_last_rank: the last rank's) make such copies, checked."""
    from megatron_mok.comm.exchange import CollectiveExchange

    num_ranks, t, h, f, e, k = 4, 64, 128, 128, 2, 4
    problem = make_ranks_problem(num_ranks, t, h, f, e, k, routing, "cpu", torch.bfloat16, 23)
    kernel_config = dataclasses.replace(_configs()[0], fp8_cache_weights=cache_weights)
    want = run_concatenated(problem, kernel_config)
    monkeypatch.setattr(CollectiveExchange, "windowed", True)
    windowed = dataclasses.replace(kernel_config, receive_capacity_factor=0.3)
    group = EmulatedGroup(num_ranks, "cpu")
    num_windows = functional.plan_for(CollectiveExchange(group.ranks[0]), t, k, e, windowed).num_windows
    assert num_windows > 2
    made, for_segments = [], []
    act, quantize_weight = SIMULATED["fp8_quantize_swiglu"], ops.fp8_quantize_weight
    monkeypatch.setattr(ops, "fp8_quantize_swiglu", lambda *a, **kw: made.append(1) or act(*a, **kw))

    def recording_quantize_weight(weight, *args, transposed=True, expert_offsets=None, **kwargs):
        if not transposed and expert_offsets is not None:  # a forward copy for a GEMM's segments
            for_segments.append(weight.shape[0])
        return quantize_weight(weight, *args, transposed=transposed, expert_offsets=expert_offsets, **kwargs)

    monkeypatch.setattr(ops, "fp8_quantize_weight", recording_quantize_weight)
    assert_bitwise(run_emulated(group, problem, e, windowed), want, "gate/up made again")
    assert len(made) == num_ranks * num_windows, (len(made), num_ranks, num_windows)
    # (routing "skewed" leaves the later windows of every rank without rows: none made again there)
    if routing != "skewed":
        assert bool(for_segments) != cache_weights, (routing, cache_weights, for_segments)
    # Where act comes from the gate/up GEMM's epilogue (no launch of its own), backward makes gate/up
    # again through that same kernel: its gate_up is then the forward's by construction.
    monkeypatch.setattr(tuning, "FP8_ACT_QUANTIZE", "gemm_epilogue")
    fused, sim_fused = [], SIMULATED["fp8_expert_gemm_swiglu"]
    monkeypatch.setattr(ops, "fp8_expert_gemm_swiglu", lambda *a, **kw: fused.append(1) or sim_fused(*a, **kw))
    assert_bitwise(run_emulated(group, problem, e, windowed), want, "gate/up made again, act in the epilogue")
    assert len(fused) == num_ranks * (2 * num_windows - 1), (len(fused), num_ranks, num_windows)
    # The BF16 kernel backend: the grouped_mm gate/up (auto's) is made again without its SwiGLU launch;
    # the sm90 one makes act in its epilogue, so backward goes through dispatch_gate_up.
    assert stages_for("kernel", "auto", None).recompute_gate_up is not None
    assert stages_for("kernel", "sm90", None).recompute_gate_up is None


@pytest.mark.parametrize("weight_grad", [True, False])
def test_the_fc2_weight_gradient_quantizes_w_dy_straight_from_dy(simulated_kernels, monkeypatch, weight_grad):
    """With FP8 weight gradients and dY in one tensor the fc2 weight gradient's w * dY operand is
    quantized from dY and the route weights (ops.fp8_quantize_columns row_index, row_weights): the
    pull kernel runs on dY's FP8 scales only (the dgrad's rows), never on bf16 dY rows; with BF16
    weight gradients the bf16 rows are pulled as without FP8. The layer bitwise the reference's."""
    pulled, weighted = [], []
    pull, columns = SIMULATED["pull_grad_rows"], SIMULATED["fp8_quantize_columns"]

    def recording_pull(grad_y_all, *args, **kwargs):
        pulled.append(grad_y_all.dtype)
        return pull(grad_y_all, *args, **kwargs)

    def recording_columns(*args, row_weights=None, **kwargs):
        weighted.append(row_weights is not None)
        return columns(*args, row_weights=row_weights, **kwargs)

    monkeypatch.setattr(ops, "pull_grad_rows", recording_pull)
    monkeypatch.setattr(ops, "fp8_quantize_columns", recording_columns)
    problem = make_problem(SHAPES["small"], "skewed", torch.bfloat16, seed=9)
    kernel_config, reference_config = _configs(weight_grad=weight_grad)
    _assert_equal(run_layer(*problem, config=kernel_config), run_layer(*problem, config=reference_config), "w dY")
    assert (torch.bfloat16 in pulled) != weight_grad, f"weight_grad={weight_grad}: pulled {pulled}"
    assert any(weighted) == weight_grad, f"weight_grad={weight_grad}: weighted columns {weighted}"


def test_the_reference_backward_over_windows_quantizes_each_weight_once_without_the_cache(monkeypatch):
    """The reference backend without the weight cache, over several receive windows: each rank's
    forward quantizes fc1 and fc2 once for all its windows, and so does its backward (its whole
    forward copies held for the pass, the transposed ones made from them once: fp8_weights.copies_held),
    not once per window; the pass bitwise the one-window one."""
    from megatron_mok.comm.exchange import CollectiveExchange

    num_ranks, t, h, f, e, k = 4, 64, 128, 128, 2, 4
    problem = make_ranks_problem(num_ranks, t, h, f, e, k, "uniform", "cpu", torch.bfloat16, 24)
    config = dataclasses.replace(_configs()[1], fp8_cache_weights=False)
    want = run_concatenated(problem, config)
    monkeypatch.setattr(CollectiveExchange, "windowed", True)
    windowed = dataclasses.replace(config, receive_capacity_factor=0.3)
    group = EmulatedGroup(num_ranks, "cpu")
    assert functional.plan_for(CollectiveExchange(group.ranks[0]), t, k, e, windowed).num_windows > 2
    made, quantize_weight = [], fp8_weights.quantize_weight
    monkeypatch.setattr(fp8_weights, "quantize_weight", lambda *a, **kw: made.append(1) or quantize_weight(*a, **kw))
    assert_bitwise(run_emulated(group, problem, e, windowed), want, "reference over windows")
    assert len(made) == num_ranks * 2 * 2, (len(made), num_ranks)


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_the_weight_gradient_operands_from_the_ranks_regions_equal_the_pulled_rows(num_ranks, simulated_kernels,
                                                                                    monkeypatch):
    """tuning.FP8_WGRAD_COLUMNS_FROM_PEERS over the ranks' symmetric regions (simulated: each region a
    CPU tensor behind a fake address): fc1's x rows and fc2's w * dY are quantized column-wise from
    the regions (ops.fp8_quantize_columns_from_peers, the routes' weights copied out of the regions
    by ops.gather_peer_regions), with no pull, bitwise the pulled rows' columns (the setting off:
    ops.dispatch_rows_from_peers and pull_grad_rows_from_peers, then the columns); the rows are the
    group's (rank g // T's token g % T), the weights the group's routes."""
    from megatron_mok.comm.exchange import GradSource, RowSource
    from megatron_mok.schedule import build_schedule_from_gathered

    t, h, e, k, rank = 70, 256, 3, 2, num_ranks - 1
    gen = torch.Generator().manual_seed(num_ranks)
    regions = {4096 * (i + 1): torch.randn(t, h, generator=gen).bfloat16() for i in range(num_ranks)}
    grad_regions = {4096 * (i + 101): torch.randn(t, h, generator=gen).bfloat16() for i in range(num_ranks)}
    weight_regions = {4096 * (i + 201): torch.rand(t * k, generator=gen) for i in range(num_ranks)}
    at = {**regions, **grad_regions, **weight_regions}

    def stacked(ptrs):
        return torch.cat([at[p] for p in ptrs])

    called = []

    def columns_from_peers(own, peer_ptrs, expert_offsets=None, *, pow2=False, row_index, row_weights=None):
        _meets_the_op_contract(fp8_quant.check_fp8_quantize_columns_from_peers_args, own, peer_ptrs, expert_offsets,
                               pow2, row_index, row_weights)
        assert own is at[peer_ptrs[rank]], "own is this rank's region"
        called.append("columns_from_peers")
        return _sim_fp8_quantize_columns(stacked(peer_ptrs), expert_offsets, pow2=pow2, row_index=row_index,
                                         row_weights=row_weights)

    def pulled(name, sim):
        return lambda *a, **kw: called.append(name) or sim(*a, **kw)

    monkeypatch.setattr(ops, "fp8_quantize_columns_from_peers", columns_from_peers)
    monkeypatch.setattr(ops, "gather_peer_regions", lambda own, ptrs: torch.stack([at[p] for p in ptrs]))
    monkeypatch.setattr(ops, "dispatch_rows_from_peers", pulled(
        "pull", lambda own, ptrs, route, topk, offsets=None: _sim_dispatch_rows(stacked(ptrs), route, topk, offsets)))
    monkeypatch.setattr(ops, "pull_grad_rows_from_peers", pulled(
        "pull", lambda own, ptrs, wptrs, route, topk, offsets=None: _sim_pull_grad_rows(
            stacked(ptrs), stacked(wptrs), route, topk, offsets)))
    ids = torch.rand(num_ranks, t, num_ranks * e, generator=gen).topk(k, dim=2).indices
    ids[0, 0, 0] = -1  # a dropped route
    schedule = build_schedule_from_gathered(ids, rank=rank, num_local_experts=e, segment_alignment=128)
    offsets = schedule.expert_offsets
    x = RowSource(list(regions.values())[rank], tuple(regions))
    grads = GradSource(RowSource(list(grad_regions.values())[rank], tuple(grad_regions)),
                       RowSource(list(weight_regions.values())[rank], tuple(weight_regions)))
    operands = {}
    for from_peers in (False, True):
        monkeypatch.setattr(tuning, "FP8_WGRAD_COLUMNS_FROM_PEERS", from_peers)
        called.clear()
        rows, route_grads = kernel_fp8.weight_grad_rows(x, schedule), kernel_fp8.weight_grad_route_grads(grads, schedule)
        assert isinstance(rows, kernel_fp8.RowsToGather) == from_peers
        assert isinstance(route_grads, kernel_fp8.RowsToGather) == from_peers
        operands[from_peers] = [kernel_fp8._quantize_columns(r, offsets, False) for r in (rows, route_grads)]
        assert called == (["columns_from_peers"] * 2 if from_peers else ["pull"] * 2), called
    for (q, scales), (want_q, want_scales) in zip(operands[True], operands[False]):
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_the_pushed_down_rows_and_dgrad_rows_equal_the_rows_pushed(num_ranks, simulated_kernels, monkeypatch):
    """expert_down_pushed and dgrad_rows_pushed (tuning.FP8_PUSH_IN_EPILOGUE: ops.fp8_expert_gemm_push,
    simulated: the reference product written where ops.push_rows puts a row; the regions CPU tensors
    at their own addresses) leave every rank's combine region as expert_down and dgrad_rows followed
    by the push do, bit for bit, through the dgrad's expert ranges too; the op's contract holds for
    the stages' arguments."""
    from megatron_mok.comm.exchange import PushTarget
    from megatron_mok.schedule import build_schedule_from_gathered

    t, h, f, e, k, rank = 70, 256, 128, 3, 2, num_ranks - 1
    gen = torch.Generator().manual_seed(20 + num_ranks)
    ids = torch.rand(num_ranks, t, num_ranks * e, generator=gen).topk(k, dim=2).indices
    ids[0, 0, 0] = -1  # a dropped route
    schedule = build_schedule_from_gathered(ids, rank=rank, num_local_experts=e, segment_alignment=128)
    offsets, capacity = schedule.expert_offsets, schedule.slot_to_route.shape[0]
    recipe = Fp8Recipe()
    fc1 = torch.randn(e, 2 * f, h, generator=gen).bfloat16() / h**0.5
    fc2 = torch.randn(e, h, f, generator=gen).bfloat16() / f**0.5
    act_rows = _zero_past_end(torch.randn(capacity, f, generator=gen).bfloat16(), offsets)
    q, scales = quantization.quantize_rowwise(act_rows)
    act = kernel_fp8.GemmOperand(q, quantization.gemm_a_scales(scales))
    grad_gate_up = _zero_past_end(torch.randn(capacity, 2 * f, generator=gen).bfloat16(), offsets)

    def regions():
        made = [torch.full((t * k, h), float("nan"), dtype=torch.bfloat16) for _ in range(num_ranks)]
        return made, {r.data_ptr(): r for r in made}

    def push_into(at, slot_rows, slot_to_route):
        for slot, route in enumerate(slot_to_route.tolist()):
            if route >= 0:
                at_rank = list(at.values())[route // (t * k)]
                at_rank[route % (t * k)] = slot_rows[slot]

    pushed_launches = []

    def sim_push(a, a_scales, weight, weight_scales, expert_offsets, cluster_m, group_m, *, slot_to_route, topk,
                 num_tokens, own_combine, peer_combine_ptrs, variant="default"):
        _meets_the_op_contract(fp8_gemm.check_fp8_expert_gemm_push_args, a, a_scales, weight, weight_scales,
                               expert_offsets, cluster_m, group_m, slot_to_route, topk, num_tokens, own_combine,
                               peer_combine_ptrs, variant)
        assert own_combine is at[peer_combine_ptrs[rank]] and (topk, num_tokens) == (k, t)
        pushed_launches.append(weight.shape[0])
        product = ops.fp8_expert_gemm_reference(a, a_scales, weight, weight_scales, expert_offsets).bfloat16()
        begin, end = int(expert_offsets[0]), int(expert_offsets[-1])
        routes = torch.where(torch.arange(len(slot_to_route)).ge(begin) & torch.arange(len(slot_to_route)).lt(end),
                             slot_to_route, -1)
        push_into(at, product, routes)

    monkeypatch.setattr(ops, "fp8_expert_gemm_push", sim_push)
    monkeypatch.setattr(tuning, "FP8_DGRAD_EXPERT_RANGES", 2)  # two launches over E = 3 experts
    for name, pushed, made in (
        ("down", lambda target: kernel_fp8.expert_down_pushed(act, fc2, offsets, target, recipe=recipe),
         lambda: kernel_fp8.expert_down(act, fc2, offsets, recipe=recipe)),
        ("dgrad", lambda target: kernel_fp8.dgrad_rows_pushed(grad_gate_up, fc1, offsets, target, recipe=recipe),
         lambda: kernel_fp8.dgrad_rows(grad_gate_up, fc1, offsets, recipe=recipe)),
    ):
        want, at = regions()
        push_into(at, made(), schedule.slot_to_route)
        got, at = regions()
        pushed_launches.clear()
        pushed(PushTarget(schedule.slot_to_route, k, t, got[rank], tuple(at)))
        assert pushed_launches == ([3] if name == "down" else [2, 1]), f"{name}: launches over {pushed_launches} experts"
        for index, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"{name}: rank {index}'s region differs"
    stages = stages_for("kernel", "auto", Fp8Recipe())
    assert stages.expert_down_pushed is not None and stages.dgrad_rows_pushed is not None
