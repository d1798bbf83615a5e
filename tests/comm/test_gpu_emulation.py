"""EmulatedGroup with the kernel backend on a Hopper GPU: every rank's outputs and gradients bitwise
those of the EP = 1 kernel on the concatenated problem, same expert-GEMM family (why exact: see
tests/comm/test_emulation.py)."""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.emulation import EmulatedGroup
from megatron_mok.receive import receive_plan
from cuda_checks import NEEDS_HOPPER_KERNELS
from test_emulation import ROUTINGS, assert_bitwise, make_problem, run_concatenated, run_emulated

pytestmark = NEEDS_HOPPER_KERNELS

# (num_ranks, num_tokens, hidden, ffn, local_experts, topk)
GPU_CASES = {
    "r2": (2, 256, 512, 256, 4, 4),
    "r4_odd_tokens": (4, 100, 256, 128, 3, 8),
    "r8": (8, 64, 512, 256, 2, 8),
    "r8_t1": (8, 1, 256, 128, 2, 2),
}
GPU_CONFIGS = {
    "auto": MoKConfig(backend="kernel"),
    "sm90_ring3": MoKConfig(backend="kernel", expert_gemm="sm90", dispatch_ring_minibatches=3),
}
# A receive capacity of a quarter of a rank's routes: every case runs several windows (asserted),
# and the skewed routings spread experts over several, so the weight gradients carry across them.
WINDOW_CONFIGS = {
    "auto_windows": MoKConfig(backend="kernel", receive_capacity_factor=0.25),
    "sm90_ring3_windows": MoKConfig(backend="kernel", expert_gemm="sm90", dispatch_ring_minibatches=3, receive_capacity_factor=0.25),
}


@pytest.mark.parametrize("exchange", ["symmetric", "collective"])
@pytest.mark.parametrize("config_name", list(GPU_CONFIGS))
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_emulated_kernel_equals_ep1_kernel_bitwise(case, routing, config_name, exchange):
    num_ranks, t, h, f, e, k = GPU_CASES[case]
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16, zlib.crc32(f"{case}/{routing}".encode()))
    config = GPU_CONFIGS[config_name]
    got = run_emulated(EmulatedGroup(num_ranks, "cuda", exchange=exchange), problem, e, config)
    torch.cuda.synchronize()
    assert_bitwise(got, run_concatenated(problem, config), f"{case}/{routing}/{config_name}/{exchange}")


# (r8_t1's 16 routes fit one 128-row window whatever the factor.)
WINDOW_CASES = [case for case in GPU_CASES if case != "r8_t1"]


@pytest.mark.parametrize("config_name", list(WINDOW_CONFIGS))
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_windowed_emulated_kernel_equals_ep1_kernel_bitwise(case, routing, config_name):
    """Over several receive windows (the symmetric exchange), still bitwise EP = 1 in one window."""
    num_ranks, t, h, f, e, k = GPU_CASES[case]
    config = WINDOW_CONFIGS[config_name]
    plan = receive_plan(num_ranks=num_ranks, num_tokens=t, topk=k, num_local_experts=e, segment_alignment=1,
                        factor=config.receive_capacity_factor, windowed=True)
    assert plan.num_windows > 1, plan
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16, zlib.crc32(f"w/{case}/{routing}".encode()))
    got = run_emulated(EmulatedGroup(num_ranks, "cuda", exchange="symmetric"), problem, e, config)
    torch.cuda.synchronize()
    assert_bitwise(got, run_concatenated(problem, config), f"{case}/{routing}/{config_name}")


@pytest.mark.parametrize("factor", [1.0, 0.25])
def test_per_rank_memory_is_within_the_bound_for_every_routing(factor):
    """Every buffer is sized by the window or the rank's own tokens: all-to-one-expert, all-to-the-
    last-rank and skewed routings allocate what a uniform one does, within layer_memory_bound."""
    from emulated_memory import per_rank_memory
    from megatron_mok.memory import layer_memory_bound

    num_ranks, t, h, f, e, k = 4, 512, 1024, 512, 4, 8
    config = MoKConfig(backend="kernel", receive_capacity_factor=factor)
    bound = layer_memory_bound(num_tokens=t, hidden=h, ffn_hidden=f, num_local_experts=e, topk=k, num_ranks=num_ranks, config=config)
    group = EmulatedGroup(num_ranks, "cuda", exchange="symmetric")
    seen = {}
    for routing in ROUTINGS:
        problem = make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16, 5)
        stats = per_rank_memory(group, problem, e, config)
        for rank, rank_stats in enumerate(stats):
            assert rank_stats["held"] <= bound.held, (routing, rank, rank_stats, bound)
            assert rank_stats["fwd_peak"] <= bound.forward_peak, (routing, rank, rank_stats, bound)
            assert rank_stats["held"] + rank_stats["bwd_peak"] <= bound.backward_peak, (routing, rank, rank_stats, bound)
        seen[routing] = [(s["held"], s["peak"]) for s in stats]
    # No routing needs more than a balanced one: the buffers' sizes do not depend on it. (Figures can
    # differ by the caching allocator's block rounding, which depends on which freed blocks the
    # device has released yet: a few MB, within the bound's per-buffer slack.)
    slack = 16 << 20
    uniform_held = max(held for held, _ in seen["uniform"])
    uniform_peak = max(peak for _, peak in seen["uniform"])
    for routing, figures in seen.items():
        for held, peak in figures:
            assert held <= uniform_held + slack and peak <= uniform_peak + slack, (routing, figures, seen["uniform"])


def test_ranks_with_different_requires_grad_meet_in_backward():
    """What crosses ranks runs on every rank whatever its own flags: rank 0's weights frozen, rank 1's
    x without grad, over several windows; every gradient that is asked for equals EP = 1's."""
    num_ranks, t, h, f, e, k = GPU_CASES["r2"]
    config = WINDOW_CONFIGS["auto_windows"]
    problem = make_problem(num_ranks, t, h, f, e, k, "skewed", "cuda", torch.bfloat16, 21)
    x, ids, weights, fc1, fc2, grad = problem
    _, (want_dx, want_dw, want_dfc1, want_dfc2) = run_concatenated(problem, config)
    xs = [x[0].clone().requires_grad_(), x[1].clone()]
    ws = [weights[r].clone().requires_grad_() for r in range(num_ranks)]
    fc1s = [fc1[:e].clone(), fc1[e:].clone().requires_grad_()]
    fc2s = [fc2[:e].clone(), fc2[e:].clone().requires_grad_()]
    group = EmulatedGroup(num_ranks, "cuda", exchange="symmetric")
    ys = group.mok_moe(xs, [ids[0], ids[1]], ws, fc1s, fc2s, config=config)
    torch.autograd.backward(ys, [grad[0], grad[1]])
    torch.cuda.synchronize()
    assert xs[1].grad is None and fc1s[0].grad is None and fc2s[0].grad is None
    assert torch.equal(xs[0].grad, want_dx[:t])
    assert torch.equal(torch.cat([w.grad for w in ws]), want_dw)
    assert torch.equal(fc1s[1].grad, want_dfc1[e:]) and torch.equal(fc2s[1].grad, want_dfc2[e:])


def _leaves(problem, num_ranks, local_experts):
    x, ids, weights, fc1, fc2, grad = problem
    e = local_experts
    return (
        [x[k].clone().requires_grad_() for k in range(num_ranks)],
        [ids[k] for k in range(num_ranks)],
        [weights[k].clone().requires_grad_() for k in range(num_ranks)],
        [fc1[k * e:(k + 1) * e].clone().requires_grad_() for k in range(num_ranks)],
        [fc2[k * e:(k + 1) * e].clone().requires_grad_() for k in range(num_ranks)],
    )


@pytest.mark.parametrize("config_name", [*GPU_CONFIGS, "auto_windows"])
def test_symmetric_emulated_step_replays_in_one_cuda_graph(config_name):
    """Every rank's forward and backward, their exchanges included, captured in one CUDA graph
    (the ranks' streams forked from the capture stream) and replayed twice, bitwise as eager."""
    from cuda_checks import assert_graph_replays_eager

    num_ranks, t, h, f, e, k = GPU_CASES["r4_odd_tokens"]
    problem = make_problem(num_ranks, t, h, f, e, k, "skewed", "cuda", torch.bfloat16, 11)
    group = EmulatedGroup(num_ranks, "cuda", exchange="symmetric")
    xs, ids, ws, fc1s, fc2s = _leaves(problem, num_ranks, e)
    leaves = [*xs, *ws, *fc1s, *fc2s]
    grad = problem[5]

    def step():
        for leaf in leaves:
            leaf.grad = None
        ys = group.mok_moe(xs, ids, ws, fc1s, fc2s, config={**GPU_CONFIGS, **WINDOW_CONFIGS}[config_name])
        torch.autograd.backward(ys, [grad[r] for r in range(num_ranks)])
        return torch.cat(ys)

    eager_y = step().detach().clone()
    eager_grads = [leaf.grad.clone() for leaf in leaves]
    assert_graph_replays_eager(step, leaves, eager_y, eager_grads)


NEVER_ARRIVES = """
import torch
from megatron_mok import MoKConfig, mok_moe, ops
from megatron_mok.emulation import EmulatedGroup
from megatron_mok.receive import receive_plan
group = EmulatedGroup(2, "cuda", exchange="symmetric")
x = torch.randn(8, 64, device="cuda").bfloat16()
ids = torch.zeros(8, 2, dtype=torch.int64, device="cuda")
w = torch.rand(8, 2, device="cuda")
fc1 = torch.randn(1, 64, 64, device="cuda").bfloat16()
fc2 = torch.randn(1, 64, 32, device="cuda").bfloat16()
try:
    # Rank 0 alone: rank 1 never publishes its routing.
    group.run_launched(lambda r: mok_moe(x, ids, w, fc1, fc2, group=group.ranks[r], config=MoKConfig(backend="kernel")), ranks=[0])
    torch.cuda.synchronize()
    print("no error")
except Exception as error:
    print("error:", type(error).__name__)
print("record:", ops.last_failure())
"""


def test_a_rank_that_never_arrives_traps_with_the_named_wait():
    from cuda_checks import run_until_trap

    record, out, elapsed = run_until_trap(NEVER_ARRIVES)
    assert "routing" in record and "peer 1" in record and "call 1" in record, out
    assert elapsed < 60, f"the bounded wait took {elapsed:.0f} s"
