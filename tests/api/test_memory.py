"""megatron_mok.memory.layer_memory_bound: what it bounds, and its terms at EP = 1 against the
design's hand count (docs/design.md §8). Its measured side is a GPU test
(tests/comm/test_gpu_emulation.py) and docs/performance.md, "EP memory"."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.memory import ALLOCATOR_BLOCK_SLACK, HELD_BUFFERS, layer_memory_bound

DSV3 = dict(num_tokens=8192, hidden=7168, ffn_hidden=2048, num_local_experts=32, topk=8)


def test_ep1_held_is_the_designs_count():
    t, h, f, k = 8192, 7168, 2048, 8
    c = t * k
    tables = 8 * (c + c + t * k)
    # y, the route table (the down outputs), gate/up, act, and the rows (auto keeps them).
    want = 2 * (t * h + c * h + c * 2 * f + c * f + c * h) + tables + HELD_BUFFERS * ALLOCATOR_BLOCK_SLACK
    assert layer_memory_bound(**DSV3).held == want


def test_ep8_does_not_grow_with_ep_beyond_the_route_tables():
    bounds = [layer_memory_bound(**DSV3, num_ranks=r) for r in (2, 4, 8)]
    for bound in bounds[1:]:
        # 8-byte tables per group route: a few MB per doubling of EP, at most
        assert 0 <= bound.peak - bounds[0].peak < 64 << 20
        assert 0 <= bound.held - bounds[0].held < 16 << 20
        assert bound.window_rows == bounds[0].window_rows


def test_collective_exchange_and_non_bf16_are_not_bounded():
    with pytest.raises(ValueError, match="collective exchange"):
        layer_memory_bound(**DSV3, num_ranks=8, windowed=False)
    with pytest.raises(ValueError, match="bf16"):
        layer_memory_bound(**DSV3, dtype=torch.float32)


def test_one_rank_over_the_symmetric_exchange_plans_its_windows():
    one = layer_memory_bound(**DSV3, config=MoKConfig(receive_capacity_factor=0.25), windowed=True)
    assert one.num_windows > 1 and one.peak < layer_memory_bound(**DSV3).peak


FP8 = MoKConfig(precision="fp8_blockwise")


def test_fp8_ep1_held_is_the_designs_count():
    """FP8 keeps gate/up only (docs/design.md §12.4): y, the route table (the down outputs), gate/up
    over the 128-row padded schedule and the index tables; the weight cache adds exactly the forward
    copies (E4M3 and 128x128 fp32 scales), held between calls."""
    from megatron_mok.memory_fp8 import FP8_HELD_BUFFERS

    t, h, f, e, k = 8192, 7168, 2048, 32, 8
    c = t * k + e * 127  # every segment padded to 128 rows, at most 127 each
    tables = 8 * (c + t * k + t * k)
    uncached = 2 * (t * h + c * h + c * 2 * f) + tables + FP8_HELD_BUFFERS * ALLOCATOR_BLOCK_SLACK
    assert layer_memory_bound(**DSV3, config=dataclasses.replace(FP8, fp8_cache_weights=False)).held == uncached
    copies = e * 3 * f * h + 4 * e * (2 * f // 128) * (h // 128) + 4 * e * (h // 128) * (f // 128)
    assert layer_memory_bound(**DSV3, config=FP8).held == uncached + copies
    # Keeping the transposed copies beside them holds the same bytes again, and adds nothing else.
    kept = layer_memory_bound(**DSV3, config=dataclasses.replace(FP8, fp8_cache_transposed_weights=True))
    cached = layer_memory_bound(**DSV3, config=FP8)
    assert kept.held == uncached + 2 * copies
    assert (kept.forward_peak - cached.forward_peak, kept.backward_peak - cached.backward_peak) == (copies, copies)


def test_fp8_bound_is_below_bf16s_without_the_cache_and_does_not_grow_with_ep():
    uncached = dataclasses.replace(FP8, fp8_cache_weights=False)
    assert layer_memory_bound(**DSV3, config=uncached).peak < layer_memory_bound(**DSV3).peak
    bounds = [layer_memory_bound(**DSV3, num_ranks=r, config=FP8) for r in (2, 4, 8)]
    for bound in bounds[1:]:
        assert 0 <= bound.peak - bounds[0].peak < 64 << 20
        assert 0 <= bound.held - bounds[0].held < 16 << 20
    # Its symmetric regions add the FP8 rows and scales of x and dY to the bf16 regions.
    assert bounds[0].symmetric > layer_memory_bound(**DSV3, num_ranks=2).symmetric


def test_fp8_windows_bound_one_window_at_a_time():
    """Smaller receive windows, a smaller bound: the stages are bounded one window at a time."""
    bounds = [layer_memory_bound(**DSV3, config=dataclasses.replace(FP8, receive_capacity_factor=factor), windowed=True)
              for factor in (0.25, 0.5)]
    assert 1 < bounds[1].num_windows < bounds[0].num_windows and bounds[0].peak < bounds[1].peak


def test_fp8_one_window_bound_holds_one_expert_range_of_each_transposed_copy(monkeypatch):
    """At one window the dgrads' transposed copies are made range by range (tuning.FP8_DGRAD_EXPERT_RANGES):
    the bound falls with more ranges, by the gate/up dgrad stage's share of fc1's copy, and with the
    DeepSeek-V3 shape's 4 ranges the FP8 layer's bound is below BF16's with the weight cache too."""
    from megatron_mok.backends import tuning

    e, h, f = DSV3["num_local_experts"], DSV3["hidden"], DSV3["ffn_hidden"]
    peaks = {}
    for ranges in (1, 2, 4):
        monkeypatch.setattr(tuning, "FP8_DGRAD_EXPERT_RANGES", ranges)
        peaks[ranges] = layer_memory_bound(**DSV3, config=FP8).peak
    fc1_copy = e * 2 * f * h + 4 * e * (h // 128) * (2 * f // 128)
    assert peaks[1] - peaks[2] == fc1_copy // 2 and peaks[2] - peaks[4] == fc1_copy // 4
    assert peaks[4] < layer_memory_bound(**DSV3).peak


def test_fp8_backward_over_windows_holds_no_weight_copy_across_them():
    """Over several receive windows (EP 8) each window's weight copies are made for their GEMMs and
    freed after them (kernel_fp8._dgrad, recompute_gate_up): with or without the cache, the
    backward's terms outside its stages hold no weight copy, so the cached bound exceeds the uncached
    one by exactly the cached forward copies (the uncached one's whole fc1 copy for the recomputed
    gate/up lives in a stage that is not the largest here)."""
    e, h, f = DSV3["num_local_experts"], DSV3["hidden"], DSV3["ffn_hidden"]
    copies = e * 3 * f * h + 4 * e * (2 * f // 128) * (h // 128) + 4 * e * (h // 128) * (f // 128)
    cached = layer_memory_bound(**DSV3, num_ranks=8, config=FP8)
    uncached = layer_memory_bound(**DSV3, num_ranks=8, config=dataclasses.replace(FP8, fp8_cache_weights=False))
    assert cached.num_windows > 1
    assert cached.peak - uncached.peak == copies
    # Both transposed copies held for the pass, as before, would put it past BF16's by far more.
    transposed = copies
    assert uncached.peak < layer_memory_bound(**DSV3, num_ranks=8).peak + transposed // 2


def test_fp8_recompute_stage_counts_the_epilogues_act(monkeypatch):
    """Where act comes from the gate/up GEMM's epilogue (tuning.FP8_ACT_QUANTIZE "gemm_epilogue"), a
    window's gate/up made again in backward writes an act too (dropped after) and takes fc1's whole
    uncached copy in one launch (the act kernel's path makes it one expert range at a time): the
    recompute stage counts both, and a bound whose largest stage is that one grows by more than the act.
    One window recomputes nothing, and pow2 scales take the act kernel: no change there."""
    from megatron_mok.backends import tuning
    from megatron_mok.memory_fp8 import gemm_a_scale_bytes, weight_copy_bytes

    # Few tokens (small windows) make the recompute stage, with its uncached fc1 copy of all E
    # experts, the largest of backward's.
    shape = dict(DSV3, num_tokens=1024)
    uncached = dataclasses.replace(FP8, fp8_cache_weights=False)

    def bounds(**kwargs):
        got = {}
        for act in ("swiglu_kernel", "gemm_epilogue"):
            monkeypatch.setattr(tuning, "FP8_ACT_QUANTIZE", act)
            got[act] = layer_memory_bound(**shape, **kwargs)
        return got["swiglu_kernel"], got["gemm_epilogue"]

    kernel, epilogue = bounds(num_ranks=8, config=uncached)
    w, f = kernel.window_rows, shape["ffn_hidden"]
    assert kernel.num_windows > 1
    e, h, span = shape["num_local_experts"], shape["hidden"], tuning.fp8_dgrad_expert_span(shape["num_local_experts"])
    copies = weight_copy_bytes(e, 2 * f, h) - weight_copy_bytes(span, 2 * f, h)
    # (The act kernel's recompute stage, with one range's copy, is no longer its bound's largest.)
    act = w * f + gemm_a_scale_bytes(w, f)
    assert act < epilogue.backward_peak - kernel.backward_peak <= act + copies
    for kwargs in (dict(config=uncached), dict(num_ranks=8, config=dataclasses.replace(uncached, fp8_pow2_scales=True))):
        kernel, epilogue = bounds(**kwargs)
        assert epilogue.backward_peak == kernel.backward_peak, kwargs


@pytest.mark.parametrize("ranges", [0, -1, 2.0, True])
def test_a_bad_expert_range_setting_is_a_value_error_naming_it(monkeypatch, ranges):
    """tuning.FP8_DGRAD_EXPERT_RANGES that is not a positive int would skip experts in the dgrads (or
    divide by zero): the bound, like the dgrads (tuning.fp8_dgrad_expert_span), refuses it."""
    from megatron_mok.backends import tuning

    monkeypatch.setattr(tuning, "FP8_DGRAD_EXPERT_RANGES", ranges)
    with pytest.raises(ValueError, match="FP8_DGRAD_EXPERT_RANGES must be a positive int"):
        layer_memory_bound(**DSV3, config=FP8)


def test_ep1_backward_peak_is_the_designs_count_with_the_route_table_freed():
    """Backward frees the route table once d topk_weights has read it (functional.backward's
    release_saved, as mok_moe runs it): the bound's backward is the larger of that reader's moment
    (held + dY + d topk_weights) and the rest without the table (docs/design.md §8)."""
    from megatron_mok.memory import BACKWARD_BUFFERS, ROUTE_READER_BUFFERS

    t, h, f, e, k = 8192, 7168, 2048, 32, 8
    c = w = t * k
    slack = ALLOCATOR_BLOCK_SLACK
    bound = layer_memory_bound(**DSV3)
    route_table = 2 * c * h
    reader = bound.held + 2 * t * h + 4 * t * k + ROUTE_READER_BUFFERS * slack
    rest = (bound.held - route_table + 2 * 2 * t * h + 2 * e * 3 * f * h + 4 * t * k + 2 * w * (h + 6 * f)
            + 8 * (2 * c + w) + BACKWARD_BUFFERS * slack)
    assert bound.backward_peak == max(reader, rest) == rest
