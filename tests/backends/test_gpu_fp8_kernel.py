"""The kernel backend's FP8 blockwise layer (backends/kernel_fp8.py) on a Hopper GPU, against the
reference backend's FP8 layer on the same inputs and against float64 of the unquantized inputs
(skipped elsewhere; run on the device).

Tolerances (SQNR = 20·log10(‖want‖ / ‖want − got‖), tests/oracle.py sqnr_db):
- Against the reference backend's FP8, same inputs: both quantize the same x, dY and weights with the
  same function (bitwise), and every GEMM sums each 128-block's E4M3 products and promotes them
  per block in fp32 in ascending K order; the only arithmetic difference is inside a block, where
  the tensor cores accumulate P_b with a few bits fewer than the reference's exact sum (relative
  error below ~2^-13 per GEMM output). That rounds each bf16 output (gate_up, d act, the rows) the
  other way for a fraction ~2^-13 / 2^-8 = 1/32 of its elements (one bf16 ulp, 2^-8), and a flipped
  bf16 input of a quantization moves its E4M3 rounding for ~1 in 16 of those (one E4M3 step, 2^-4 of
  the value): about 1 element in 500 off by 2^-4, i.e. a relative RMS of 2^-4·(1/500)^(1/2) ≈ 0.003,
  ~50 dB, summed over the chain's two or three such stages ~45 dB over a large tensor. Bar 35 dB
  (the issue's): a tensor with few elements sits on few flips, and one flip is a bigger share of
  it; in a 256-wide intermediate (2F of a 128-wide expert) a flip of one E4M3 step, 2^-4..2^-3 of
  its element, carries ~2^-3/sqrt(256) of the output's norm, 42 dB, and the one-token, one-expert
  case measures 38 dB on an H200. A recipe error (a scale of the wrong block, an unpromoted block,
  a transposed weight copy that is not the transpose) costs the 20–30 dB of the quantization itself.
  Per token row of y and dx: 25 dB, the same flips counted in one row (ten of them at 42 dB each
  leave 32 dB; pow2 scales, whose blocks do not reach E4M3's top binade, measure 29.6 dB in a dx
  row of the 128-wide expert); a wrong row sits near 0 dB.
- d topk_weights (dot products of dY and the route's output, whose H terms cancel): its error
  measured against the scale of those terms (_dot_scale) rather than its own norm, which a tensor of
  a few routes can draw near zero; and each route's error is one projection of its output's error
  onto dY, so over n routes the error power is a χ²_n/n draw: the bar is lowered by that draw's
  99.9% quantile (_projection_allowance_db: 10.5 dB for one route, under 2 dB past 100 routes; the
  one-token, one-expert case measures 32 dB on an H200).
- Against float64 of the unquantized inputs: no worse than the reference recipe's own SQNR minus
  what the kernel's difference from the reference, at most the bar above, adds in power to the
  recipe's error (uncorrelated): 10·log10(1 + 10^((recipe − bar)/10)), 0.33 dB for a 24 dB recipe
  and a 35 dB bar, plus 0.5 dB.
- Determinism, CUDA-graph replay and emulated ranks: bitwise.
"""

from __future__ import annotations

import math
import sys
import zlib
from pathlib import Path

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.emulation import EmulatedGroup
from cuda_checks import NEEDS_HOPPER_KERNELS, assert_bitwise_reproducible_without_host_sync, assert_mok_moe_graph_replays_eager
from oracle import Shape, moe_float64_with_grads, route_outputs_float64, sqnr_db
from test_gpu_kernels import make_inputs, run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
from test_emulation import assert_bitwise, make_problem, run_concatenated, run_emulated  # noqa: E402

pytestmark = NEEDS_HOPPER_KERNELS

KERNEL_FP8 = MoKConfig(backend="kernel", precision="fp8_blockwise")
REFERENCE_FP8 = MoKConfig(backend="reference", precision="fp8_blockwise")
KERNEL_FP8_BF16_WGRAD = MoKConfig(backend="kernel", precision="fp8_blockwise", fp8_weight_grad=False)
REFERENCE_FP8_BF16_WGRAD = MoKConfig(backend="reference", precision="fp8_blockwise", fp8_weight_grad=False)

SHAPES = {
    "minimal": Shape(1, 128, 128, 1, 1),
    "odd_tokens": Shape(37, 256, 128, 5, 3),
    "deepseek_v3_like": Shape(128, 7168, 2048, 32, 8),
    "qwen3_30b_like": Shape(256, 2048, 768, 128, 8),
}
ROUTINGS = ("uniform", "skewed", "one_expert", "dropped")
NAMES = ("y", "dx", "dtopk_weights", "dfc1", "dfc2")
REFERENCE_BAR_DB = 35.0
ROW_BAR_DB = 25.0
FLOAT64_SLACK_DB = 0.5


def _dot_scale(inputs) -> float:
    """The norm d topk_weights has when its error is measured: sqrt(sum over routes of
    (‖dY_t‖·‖o_tk‖)² / H), o_tk the route's expert output (float64). d topk_weights[t, k] = <dY_t, o_tk>
    is a sum of H terms that cancel; over many routes its norm is about this, but one route's value
    is a ratio-of-Gaussians draw that can sit near zero, so its error is measured against the terms'
    scale (for many routes the two agree)."""
    x, ids, _, fc1, fc2, grad = inputs
    outputs = route_outputs_float64(x.double(), ids, fc1.double(), fc2.double())  # (T, K, H)
    terms = grad.double().norm(dim=1, keepdim=True) * outputs.norm(dim=2)  # (T, K)
    return float((terms.square().sum() / x.shape[1]).sqrt())


def _projection_allowance_db(num_routes: int) -> float:
    """How far below its mean a d topk_weights SQNR over `num_routes` routes may fall by chance (dB):
    each route's error is one projection <dY_t, δo_tk> of its output's error, so the error power over
    n routes is a χ²_n/n draw times its mean; its 99.9% quantile (Wilson–Hilferty, z = 3.09) is
    10.5 dB above the mean for one route, 3.9 dB for 16, 0.6 dB for 1024."""
    n = max(num_routes, 1)
    quantile = n * (1 - 2 / (9 * n) + 3.09 * math.sqrt(2 / (9 * n))) ** 3
    return 10 * math.log10(quantile / n)


def _sqnr_db(got, want, scale) -> float:
    """sqnr_db, or against `scale` (a norm) in place of ‖want‖ when one is given."""
    if scale is None:
        return sqnr_db(got, want)
    noise = float((want.double() - got.double()).norm())
    return float("inf") if noise == 0 else 20 * math.log10(scale / noise)


def _check_against_reference(inputs, kernel_config, reference_config, what):
    y_k, g_k = run(kernel_config, *inputs)
    y_r, g_r = run(reference_config, *inputs)
    y_f, g_f = moe_float64_with_grads(*inputs, device="cuda")
    dot_scale = _dot_scale(inputs)
    for name, got, ref, exact in zip(NAMES, (y_k, *g_k), (y_r, *g_r), (y_f, *g_f)):
        assert torch.isfinite(got).all(), f"{what} {name}: non-finite (unwritten) elements"
        scale, bar = None, REFERENCE_BAR_DB
        if name == "dtopk_weights":
            scale, bar = dot_scale, REFERENCE_BAR_DB - _projection_allowance_db(int((inputs[1] >= 0).sum()))
        db = _sqnr_db(got, ref, scale)
        assert db >= bar, f"{what} {name}: {db:.1f} dB against the reference backend's FP8 (bar {bar:.1f} dB)"
        # The kernel's difference from the reference (up to the bar) adds in power to the recipe's
        # own error (they are uncorrelated), plus FLOAT64_SLACK_DB.
        got_db, ref_db = _sqnr_db(got, exact, scale), _sqnr_db(ref, exact, scale)
        slack = FLOAT64_SLACK_DB + 10 * math.log10(1 + 10 ** ((min(ref_db, bar + 20) - bar) / 10))
        assert got_db >= ref_db - slack, (
            f"{what} {name}: {got_db:.2f} dB against float64, the reference recipe {ref_db:.2f} dB"
        )
        if name in ("y", "dx"):
            worst = min(sqnr_db(a, b) for a, b in zip(got, ref) if b.abs().sum() > 0) if ref.abs().sum() > 0 else float("inf")
            assert worst >= ROW_BAR_DB, f"{what} {name}: a token row at {worst:.1f} dB against the reference"


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_kernel_fp8_layer_against_the_reference_fp8_and_float64(shape_name, routing):
    inputs = make_inputs(SHAPES[shape_name], routing, seed=zlib.crc32(f"fp8/{shape_name}/{routing}".encode()) % 1000)
    _check_against_reference(inputs, KERNEL_FP8, REFERENCE_FP8, f"{shape_name}/{routing}")


def test_kernel_fp8_layer_without_tokens():
    """A rank with no tokens (T = 0): every 128-row segment is padding and no source row exists; empty
    outputs and zero weight gradients, as the reference backend gives."""
    inputs = make_inputs(Shape(0, 256, 128, 3, 2), "uniform", seed=30)
    (y_k, g_k), (y_r, g_r) = run(KERNEL_FP8, *inputs), run(REFERENCE_FP8, *inputs)
    for name, got, want in zip(NAMES, (y_k, *g_k), (y_r, *g_r)):
        assert got.shape == want.shape and torch.equal(got, want), f"{name}: {tuple(got.shape)} against {tuple(want.shape)}"
    assert not g_k[2].any() and not g_k[3].any(), "a weight gradient without tokens must be zero"


def test_kernel_fp8_layer_gives_the_same_bits_wherever_act_is_quantized(monkeypatch):
    """tuning.FP8_ACT_QUANTIZE: act quantized in the gate/up GEMM's SwiGLU epilogue or by the SwiGLU
    quantization kernel after the plain GEMM; the same act bytes and scales (the ops' tests), so the
    layer's outputs and gradients are bitwise the same either way."""
    from megatron_mok.backends import tuning

    inputs = make_inputs(SHAPES["odd_tokens"], "skewed", seed=34)
    results = {}
    for choice in tuning.FP8_ACT_QUANTIZE_CHOICES:
        monkeypatch.setattr(tuning, "FP8_ACT_QUANTIZE", choice)
        results[choice] = run(KERNEL_FP8, *inputs)
    (y_a, g_a), (y_b, g_b) = results.values()
    for name, a, b in zip(NAMES, (y_a, *g_a), (y_b, *g_b)):
        assert torch.equal(a, b), f"{name} differs between {tuning.FP8_ACT_QUANTIZE_CHOICES}"


@pytest.mark.parametrize("shape", ["odd_tokens", "deepseek_v3_like"])
@pytest.mark.parametrize("routing", ["skewed", "one_expert", "dropped"])
def test_kernel_fp8_layer_gives_the_same_bits_with_d_gate_ups_copies_from_one_pass(monkeypatch, shape, routing):
    """tuning.FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS: both FP8 copies of d gate_up from one launch
    (ops.fp8_quantize_swiglu_backward_copies) or from the SwiGLU backward's and a column quantization;
    with tuning.FP8_ACT_COLUMNS_IN_ONE_PASS act's column copy from that launch too; the same bytes (the
    ops' tests), so the layer's outputs and gradients are bitwise the same every way."""
    from megatron_mok.backends import tuning

    from megatron_mok import ops

    inputs = make_inputs(SHAPES[shape], routing, seed=35)
    results, passes = {}, []
    one_pass_op = ops.fp8_quantize_swiglu_backward_copies
    monkeypatch.setattr(ops, "fp8_quantize_swiglu_backward_copies",
                        lambda *a, **kw: passes.append(kw.get("act_columns", False)) or one_pass_op(*a, **kw))
    for one_pass, act in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(tuning, "FP8_GRAD_GATE_UP_COPIES_IN_ONE_PASS", one_pass)
        monkeypatch.setattr(tuning, "FP8_ACT_COLUMNS_IN_ONE_PASS", act)
        passes.clear()
        results[(one_pass, act)] = run(KERNEL_FP8, *inputs)
        assert set(passes) == ({act} if one_pass else set()), f"{(one_pass, act)}: the one pass ran {passes}"
    y_a, g_a = results[(False, False)]
    for way, (y_b, g_b) in results.items():
        for name, a, b in zip(NAMES, (y_a, *g_a), (y_b, *g_b)):
            assert torch.equal(a, b), f"{name} differs between the separate launches and {way} ({shape}/{routing})"


def test_kernel_fp8_layer_with_bf16_weight_gradients():
    inputs = make_inputs(SHAPES["odd_tokens"], "skewed", seed=31)
    _check_against_reference(inputs, KERNEL_FP8_BF16_WGRAD, REFERENCE_FP8_BF16_WGRAD, "fp8_weight_grad=False")


def test_kernel_fp8_layer_with_pow2_scales():
    inputs = make_inputs(SHAPES["odd_tokens"], "uniform", seed=32)
    _check_against_reference(
        inputs, MoKConfig(backend="kernel", precision="fp8_blockwise", fp8_pow2_scales=True),
        MoKConfig(backend="reference", precision="fp8_blockwise", fp8_pow2_scales=True), "pow2 scales",
    )


def test_kernel_fp8_bitwise_deterministic_without_host_sync():
    inputs = make_inputs(SHAPES["qwen3_30b_like"], "skewed", seed=33)
    assert_bitwise_reproducible_without_host_sync(lambda: run(KERNEL_FP8, *inputs))


def test_kernel_fp8_cuda_graph_replay():
    assert_mok_moe_graph_replays_eager(KERNEL_FP8, *make_inputs(SHAPES["odd_tokens"], "dropped", seed=34))


KERNEL_FP8_KEPT_TRANSPOSED = MoKConfig(backend="kernel", precision="fp8_blockwise", fp8_cache_transposed_weights=True)


@pytest.mark.parametrize("shape_name", ("odd_tokens", "qwen3_30b_like"))
def test_kept_transposed_weight_copies_give_the_same_bits(shape_name):
    """fp8_cache_transposed_weights: both copies from one quantization pass, the dgrads one launch
    over the kept copy; the first and a second forward and backward with the same weights (the kept
    copies read, nothing made) are bitwise the default layer's, which makes the transposed copies
    range of experts by range in every backward."""
    from megatron_mok import fp8_weights, mok_moe

    x, ids, w, fc1, fc2, grad = make_inputs(SHAPES[shape_name], "skewed", seed=35)
    want_y, want_grads = run(KERNEL_FP8, x, ids, w, fc1, fc2, grad)
    fp8_weights.clear()
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, fc1, fc2)]
    for call in ("first", "second"):
        for leaf in leaves:
            leaf.grad = None
        y = mok_moe(leaves[0], ids, *leaves[1:], config=KERNEL_FP8_KEPT_TRANSPOSED)
        y.backward(grad)
        for name, got, want in zip(NAMES, (y.detach(), *(leaf.grad for leaf in leaves)), (want_y, *want_grads)):
            assert torch.equal(got, want), f"{call} call: {name} differs from the default layer's"
    fp8_weights.clear()


def test_kept_transposed_weight_copies_cuda_graph_replay():
    """In a capture nothing is cached: the option's dgrads make their copies as without it."""
    assert_mok_moe_graph_replays_eager(KERNEL_FP8_KEPT_TRANSPOSED, *make_inputs(SHAPES["odd_tokens"], "dropped", seed=36))


@pytest.mark.parametrize("routing", ("uniform", "skewed", "all_to_last_rank", "dropped"))
def test_kernel_fp8_emulated_ranks_equal_ep1_bitwise(routing):
    num_ranks, t, h, f, e, k = 2, 100, 256, 128, 2, 4
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16, zlib.crc32(f"fp8k/{routing}".encode()))
    # Over the collective exchange (the symmetric one, which "auto" takes on this group: below).
    got = run_emulated(EmulatedGroup(num_ranks, "cuda", exchange="collective"), problem, e, KERNEL_FP8)
    torch.cuda.synchronize()
    assert_bitwise(got, run_concatenated(problem, KERNEL_FP8), f"fp8 kernel r2/{routing}")


# FP8 rows through the symmetric exchange (the ranks' fp8_* regions, pulled in place): emulated ranks
# on the device, one and several receive windows; the kernel backend bitwise its EP = 1 run on the
# concatenated problem, the reference (which materializes the regions) bitwise the same ranks over
# the collective exchange.
SYMMETRIC_FP8 = {
    "kernel": MoKConfig(backend="kernel", precision="fp8_blockwise", exchange="symmetric"),
    "kernel_windows": MoKConfig(backend="kernel", precision="fp8_blockwise", exchange="symmetric",
                                receive_capacity_factor=0.25),
    "reference": MoKConfig(backend="reference", precision="fp8_blockwise", exchange="symmetric"),
}


@pytest.mark.parametrize("config_name", list(SYMMETRIC_FP8))
@pytest.mark.parametrize("num_ranks", (2, 4))
@pytest.mark.parametrize("routing", ("uniform", "skewed", "all_to_last_rank", "dropped"))
def test_fp8_over_the_symmetric_exchange_equals_ep1_bitwise(routing, num_ranks, config_name):
    import dataclasses

    config = SYMMETRIC_FP8[config_name]
    t, h, f, e, k = 64, 256, 128, 2, 4
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16,
                           zlib.crc32(f"fp8sym/{routing}/{num_ranks}".encode()))
    got = run_emulated(EmulatedGroup(num_ranks, "cuda"), problem, e, config)
    torch.cuda.synchronize()
    if config.backend == "kernel":
        want = run_concatenated(problem, dataclasses.replace(config, exchange="auto"))
    else:
        # The reference's torch reductions (d topk_weights' einsum) pick their cuBLAS kernels by the
        # number of tokens, so a rank's T rows and EP = 1's R*T rows may round apart: it is held to
        # the collective exchange on the same ranks, which moves the same rows by another path.
        collective = EmulatedGroup(num_ranks, "cuda", exchange="collective")
        want = run_emulated(collective, problem, e, dataclasses.replace(config, exchange="auto"))
    assert_bitwise(got, want, f"fp8 symmetric {config_name} r{num_ranks}/{routing}")


@pytest.mark.parametrize("factor", (1.0, 0.25))
@pytest.mark.parametrize("num_ranks", (2, 4))
@pytest.mark.parametrize("routing", ("uniform", "skewed", "all_to_last_rank", "dropped"))
def test_fp8_weight_gradients_from_the_ranks_regions_equal_ep1_bitwise(monkeypatch, routing, num_ranks, factor):
    """tuning.FP8_WGRAD_COLUMNS_FROM_PEERS: the weight gradients' x and w * dY operands quantized
    column-wise straight from the ranks' regions (ops.fp8_quantize_columns_from_peers) instead of
    pulled rows, in one window and several: the emulated ranks bitwise the EP = 1 run."""
    import dataclasses

    from megatron_mok.backends import tuning

    monkeypatch.setattr(tuning, "FP8_WGRAD_COLUMNS_FROM_PEERS", True)
    config = dataclasses.replace(SYMMETRIC_FP8["kernel"], receive_capacity_factor=factor)
    t, h, f, e, k = 64, 256, 128, 2, 4
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16,
                           zlib.crc32(f"fp8peers/{routing}/{num_ranks}/{factor}".encode()))
    got = run_emulated(EmulatedGroup(num_ranks, "cuda"), problem, e, config)
    torch.cuda.synchronize()
    want = run_concatenated(problem, dataclasses.replace(config, exchange="auto"))
    assert_bitwise(got, want, f"fp8 columns from peers r{num_ranks}/{routing}/{factor}")


def test_auto_runs_the_fp8_kernels():
    """backend="auto" with FP8 on Hopper is the kernel backend (bitwise), as for bf16, not the
    reference recipe."""
    from megatron_mok import mok_moe

    x, ids, weights, fc1, fc2, grad = make_inputs(Shape(64, 256, 128, 4, 2), "uniform", seed=21)
    results = {}
    for backend in ("auto", "kernel", "reference"):
        leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]
        y = mok_moe(leaves[0], ids, *leaves[1:], config=MoKConfig(backend=backend, precision="fp8_blockwise"))
        y.backward(grad)
        results[backend] = [y.detach()] + [leaf.grad for leaf in leaves]
    for name, a, b in zip(NAMES, results["auto"], results["kernel"]):
        assert torch.equal(a, b), f"auto's {name} is not the kernel backend's"
    assert not all(torch.equal(a, b) for a, b in zip(results["auto"], results["reference"])), "auto ran the reference"
