"""Receive windows (megatron_mok/receive.py): the plan, the windows' views, and a windowed pass on
CPU equal to a one-window pass (the collective exchange made windowed for the test: it copies the
windows into one buffer, so only the windowing itself is tested here; the GPU tests run the
symmetric exchange's windows against EP = 1 bitwise, tests/comm/test_gpu_emulation.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.comm.exchange import CollectiveExchange
from megatron_mok.emulation import EmulatedGroup
from megatron_mok.limits import EXPERT_GEMM_TILE_M, EXPERT_WGRAD_K_ROWS, schedule_capacity
from megatron_mok.receive import receive_plan, windows
from megatron_mok.schedule import build_schedule_torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
from test_emulation import make_problem, run_concatenated, run_emulated  # noqa: E402

from oracle import (  # noqa: E402
    assert_close_reordered_sum, assert_norm_relative, moe_float64_with_grads, oracle_bound, weight_grad_abs_sums,
)


def plan(num_ranks, t=1024, k=8, e=8, alignment=1, factor=1.0, windowed=True):
    return receive_plan(
        num_ranks=num_ranks, num_tokens=t, topk=k, num_local_experts=e, segment_alignment=alignment,
        factor=factor, windowed=windowed,
    )


def test_one_rank_or_the_collective_exchange_is_one_window_of_the_schedule():
    for p in (plan(1), plan(8, windowed=False), plan(8, factor=8.0)):
        assert p.num_windows == 1 and p.window_rows == p.capacity and p.segment_alignment == 1


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("alignment", [1, 16, 128])
def test_windows_cover_the_schedule_in_tiles_aligned_for_the_weight_gradient_carry(num_ranks, alignment):
    t, k, e = 1000, 8, 6
    p = plan(num_ranks, t, k, e, alignment)
    assert p.segment_alignment % EXPERT_WGRAD_K_ROWS == 0 and p.segment_alignment % alignment == 0
    assert p.capacity == schedule_capacity(num_ranks * t * k, e, p.segment_alignment)
    assert p.window_rows % EXPERT_GEMM_TILE_M == 0
    # A balanced routing (t*k routes here, each segment padded) fits the first window.
    assert p.window_rows >= t * k + e * (p.segment_alignment - 1)
    assert (p.num_windows - 1) * p.window_rows < p.capacity <= p.num_windows * p.window_rows
    # The window does not grow with EP.
    assert p.window_rows == plan(2, t, k, e, alignment).window_rows


def test_window_rows_follow_the_factor():
    assert plan(8, factor=0.5).window_rows < plan(8, factor=1.0).window_rows < plan(8, factor=2.0).window_rows


def test_windows_are_views_of_the_schedule_with_clamped_offsets():
    gen = torch.Generator().manual_seed(3)
    num_ranks, t, k, e = 4, 50, 4, 3
    p = plan(num_ranks, t, k, e, factor=0.5)
    assert p.num_windows > 1
    ids = torch.randint(0, num_ranks * e, (num_ranks, t, k), generator=gen)
    ids[0, :, :] = 0  # one expert takes more than a window
    schedule = build_schedule_torch(ids, rank=0, num_local_experts=e, segment_alignment=p.segment_alignment)
    parts = windows(schedule, p)
    assert [w.index for w in parts] == list(range(p.num_windows)) and parts[-1].last
    joined = torch.cat([w.schedule.slot_to_route for w in parts])
    assert torch.equal(joined[: p.capacity], schedule.slot_to_route)
    assert bool((joined[p.capacity:] == -1).all())
    for w in parts:
        assert w.begin == w.index * p.window_rows and w.rows == p.window_rows
        want = (schedule.expert_offsets.long() - w.begin).clamp(0, p.window_rows)
        assert torch.equal(w.schedule.expert_offsets.long(), want)
        assert torch.equal(w.full_offsets, schedule.expert_offsets)


@pytest.mark.parametrize("routing", ["uniform", "one_expert_rank0", "dropped"])
def test_a_windowed_pass_equals_one_window_on_cpu(monkeypatch, routing):
    num_ranks, t, h, f, e, k = 4, 64, 16, 8, 2, 4
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cpu", torch.float32, 17)
    want = run_concatenated(problem, MoKConfig())
    monkeypatch.setattr(CollectiveExchange, "windowed", True)
    config = MoKConfig(receive_capacity_factor=0.3)
    assert plan(num_ranks, t, k, e, factor=0.3).num_windows > 2
    y, grads = run_emulated(EmulatedGroup(num_ranks, "cpu"), problem, e, config)
    # The windowed pass against the float64 oracle (scheme 3): a row missed or doubled by the windows
    # moves y or a gradient by far more than fp32 rounding.
    x, ids, weights, fc1, fc2, grad = problem
    x, ids, weights, grad = (a.reshape(num_ranks * t, -1) for a in (x, ids, weights, grad))  # EP = 1's tokens
    y_exact, grads_exact = moe_float64_with_grads(x, ids, weights, fc1, fc2, grad)
    for name, got, value in zip(("y", "dx", "dtopk_weights", "dfc1", "dfc2"), (y, *grads), (y_exact, *grads_exact)):
        assert_norm_relative(got, value, oracle_bound(torch.float32), msg=f"{routing}: {name}")
    # The weight gradients against the one-window pass's (scheme 2): each is the same sum over an
    # expert's rows of products of per-row values, as window partials added in fp32 against one GEMM.
    abs_fc1, abs_fc2, num_routes = weight_grad_abs_sums(x, ids, weights, fc1, fc2, grad)
    for name, got, value, abs_sum in (("dfc1", grads[2], want[1][2], abs_fc1), ("dfc2", grads[3], want[1][3], abs_fc2)):
        assert_close_reordered_sum(got, value, abs_sum, num_routes.view(-1, 1, 1), msg=f"{routing}: {name}")


def test_receive_capacity_factor_is_checked():
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="receive_capacity_factor"):
            MoKConfig(receive_capacity_factor=bad)
