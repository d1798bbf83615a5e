"""The FP8 blockwise layer's memory on a Hopper GPU against its stated bound
(megatron_mok.memory.layer_memory_bound, megatron_mok/memory_fp8.py): per rank, for every routing, at
EP = 1 and over the symmetric exchange in one window and several, with and without the weight cache;
no routing needs more than a uniform one; and the FP8 layer's peak stays within the BF16 layer's."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.emulation import EmulatedGroup
from megatron_mok.memory import layer_memory_bound
from cuda_checks import NEEDS_HOPPER_KERNELS
from emulated_memory import per_rank_memory
from test_emulation import ROUTINGS, make_problem

pytestmark = NEEDS_HOPPER_KERNELS

# (num_ranks, num_tokens, hidden, ffn, local_experts, topk): H and F multiples of 128, large enough
# that a window's buffers (tens of MB each) outweigh the bound's 1 MB per buffer.
SHAPES = {"ep1": (1, 4096, 2048, 1024, 8, 8), "ep4": (4, 1024, 1024, 512, 4, 8)}
# Two bf16 figures of one routing differ by the caching allocator's block rounding (which freed
# blocks the device has released yet): a few MB, within the bound's per-buffer slack.
ALLOCATOR_SLACK = 16 << 20


def _config(cache: bool, factor: float, kept_transposed: bool = False) -> MoKConfig:
    return MoKConfig(backend="kernel", precision="fp8_blockwise", fp8_cache_weights=cache, receive_capacity_factor=factor,
                     fp8_cache_transposed_weights=kept_transposed)


def _measure(shape: str, config: MoKConfig, routing: str, fresh_weight_copies: bool = False) -> list[dict]:
    num_ranks, t, h, f, e, k = SHAPES[shape]
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16, 31)
    group = None if num_ranks == 1 else EmulatedGroup(num_ranks, "cuda", exchange="symmetric")
    return per_rank_memory(group, problem, e, config, fresh_weight_copies)


# (shape, receive capacity factor, windows): EP = 4 in one window (a factor of 4 holds every route
# of the group), in 4 and in several more.
CASES = [("ep1", 1.0, 1), ("ep4", 4.0, 1), ("ep4", 1.0, 4), ("ep4", 0.25, None)]


@pytest.mark.parametrize("cache", ["cached", "cached_fresh", "uncached"])
@pytest.mark.parametrize("shape,factor,windows", CASES)
def test_fp8_per_rank_memory_is_within_the_bound_for_every_routing(shape, factor, windows, cache):
    """cached_fresh: the measured call makes the cached weight copies (the first microbatch after an
    optimizer step), which the bound counts in held; cached: it finds them made (a later one)."""
    _assert_within_the_bound(shape, factor, windows, cache)


@pytest.mark.parametrize("cache", ["cached", "uncached"])
def test_fp8_memory_with_act_from_the_gate_up_epilogue_is_within_the_bound(monkeypatch, cache):
    """tuning.FP8_ACT_QUANTIZE "gemm_epilogue": over several windows backward makes gate/up again
    through the SwiGLU-epilogue GEMM, whose act the bound's recompute stage counts."""
    from megatron_mok.backends import tuning

    monkeypatch.setattr(tuning, "FP8_ACT_QUANTIZE", "gemm_epilogue")
    _assert_within_the_bound("ep4", 0.25, None, cache)


@pytest.mark.parametrize("factor,windows", [(1.0, 4), (0.25, None)])
def test_fp8_memory_with_the_weight_gradients_from_the_ranks_regions_is_within_the_bound(monkeypatch, factor, windows):
    """tuning.FP8_WGRAD_COLUMNS_FROM_PEERS: no pulled rows for the weight gradients; the bound's
    weight gradient stages count the row indices and the routes' weights instead."""
    from megatron_mok.backends import tuning

    monkeypatch.setattr(tuning, "FP8_WGRAD_COLUMNS_FROM_PEERS", True)
    _assert_within_the_bound("ep4", factor, windows, "uncached")


@pytest.mark.parametrize("cache", ["kept", "kept_fresh"])
@pytest.mark.parametrize("shape,factor,windows", [("ep1", 1.0, 1), ("ep4", 0.25, None)])
def test_fp8_memory_with_the_transposed_weight_copies_kept_is_within_the_bound(shape, factor, windows, cache):
    """MoKConfig.fp8_cache_transposed_weights: both copies of each weight held from the first forward
    (kept_fresh: made in the measured call) to the optimizer step, which the bound counts in held;
    the dgrads make no copies then."""
    _assert_within_the_bound(shape, factor, windows, cache)


def _assert_within_the_bound(shape: str, factor: float, windows, cache: str) -> None:
    num_ranks, t, h, f, e, k = SHAPES[shape]
    config = _config(cache != "uncached", factor, kept_transposed=cache.startswith("kept"))
    bound = layer_memory_bound(num_tokens=t, hidden=h, ffn_hidden=f, num_local_experts=e, topk=k,
                               num_ranks=num_ranks, config=config)
    assert bound.num_windows == windows if windows else bound.num_windows > 4, bound
    seen = {}
    for routing in ROUTINGS:
        stats = _measure(shape, config, routing, fresh_weight_copies=cache.endswith("_fresh"))
        for rank, rank_stats in enumerate(stats):
            context = (routing, rank, rank_stats, bound)
            assert rank_stats["held"] <= bound.held, context
            assert rank_stats["fwd_peak"] <= bound.forward_peak, context
            assert rank_stats["held"] + rank_stats["bwd_peak"] <= bound.backward_peak, context
        seen[routing] = [(s["held"], s["peak"]) for s in stats]
        print(f"{shape} factor {factor} {cache} {routing}: held/peak MB per rank "
              f"{[(round(a / 2**20, 1), round(b / 2**20, 1)) for a, b in seen[routing]]}; bound "
              f"{bound.held / 2**20:.1f}/{bound.peak / 2**20:.1f}")
    uniform_held = max(held for held, _ in seen["uniform"])
    uniform_peak = max(peak for _, peak in seen["uniform"])
    for routing, figures in seen.items():
        for held, peak in figures:
            assert held <= uniform_held + ALLOCATOR_SLACK and peak <= uniform_peak + ALLOCATOR_SLACK, (routing, figures, seen["uniform"])


@pytest.mark.parametrize("cache", ["uncached", "cached_fresh"])
@pytest.mark.parametrize("routing", ["uniform", "one_expert_rank0"])
def test_fp8_peak_is_within_the_bf16_layers(routing, cache):
    """The recipe's memory requirement at EP = 1: FP8 keeps gate/up only (the bf16 layer keeps the
    rows, gate/up and act), and its dgrads hold one expert range of a transposed weight copy at a time,
    so its peak is at most BF16's, whether every forward quantizes its weights or the cached copies are
    made in the measured call and held past it."""
    fp8 = max(s["peak"] for s in _measure("ep1", _config(cache != "uncached", 1.0), routing,
                                          fresh_weight_copies=cache == "cached_fresh"))
    bf16 = max(s["peak"] for s in _measure("ep1", MoKConfig(backend="kernel"), routing))
    assert fp8 <= bf16, (fp8, bf16)
