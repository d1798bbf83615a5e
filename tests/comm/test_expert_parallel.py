"""mok_moe with EP = 2 and 4 gloo processes against the float64 oracle of the whole problem."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.distributed

NUM_TOKENS, HIDDEN, FFN, LOCAL_EXPERTS, TOPK = 9, 16, 8, 2, 3


def _global_problem(num_ranks: int, routing: str):
    gen = torch.Generator().manual_seed(1000 + num_ranks)
    num_experts = num_ranks * LOCAL_EXPERTS
    x = torch.randn(num_ranks, NUM_TOKENS, HIDDEN, generator=gen)
    ids = torch.randint(0, num_experts, (num_ranks, NUM_TOKENS, TOPK), generator=gen)
    if routing == "dropped":
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, -1, ids)
    elif routing == "one_expert":
        ids.fill_(num_experts - 1)  # every route of every rank to the last rank's last expert
    elif routing == "one_rank_empty":
        ids = ids % LOCAL_EXPERTS  # rank 0's experts only: the other ranks compute nothing
    weights = torch.rand(num_ranks, NUM_TOKENS, TOPK, generator=gen)
    fc1 = torch.randn(num_experts, 2 * FFN, HIDDEN, generator=gen) / HIDDEN**0.5
    fc2 = torch.randn(num_experts, HIDDEN, FFN, generator=gen) / FFN**0.5
    grad = torch.randn(num_ranks, NUM_TOKENS, HIDDEN, generator=gen)
    return x, ids, weights, fc1, fc2, grad


def _run_local(rank, x, ids, weights, fc1, fc2, grad, group):
    from megatron_mok import mok_moe

    own = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    leaves = [t.clone().requires_grad_() for t in (x[rank], weights[rank], fc1[own], fc2[own])]
    y = mok_moe(leaves[0], ids[rank], leaves[1], leaves[2], leaves[3], group=group)
    y.backward(grad[rank])
    return y.detach(), [leaf.grad for leaf in leaves]


ROUTINGS = ("dropped", "one_expert", "one_rank_empty")


def _ep_body(rank, world_size):
    # One spawn checks every routing (process start-up dominates on CI's two cores); failures
    # are collected so the first one does not hide the others.
    failures = []
    for routing in ROUTINGS:
        try:
            _check_routing(rank, world_size, routing)
        except AssertionError as error:
            failures.append(str(error))
    assert not failures, "\n".join(failures)


def _check_routing(rank, world_size, routing):
    import torch.distributed as dist

    from oracle import assert_norm_relative, moe_float64_with_grads, oracle_bound

    x, ids, weights, fc1, fc2, grad = _global_problem(world_size, routing)
    y, grads = _run_local(rank, x, ids, weights, fc1, fc2, grad, dist.group.WORLD)

    y_ref, ref_grads = moe_float64_with_grads(
        x.reshape(-1, HIDDEN), ids.reshape(-1, TOPK), weights.reshape(-1, TOPK), fc1, fc2, grad.reshape(-1, HIDDEN)
    )
    mine = slice(rank * NUM_TOKENS, (rank + 1) * NUM_TOKENS)
    own = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    checks = {
        "y": (y, y_ref[mine]),
        "dx": (grads[0], ref_grads[0][mine]),
        "dweights": (grads[1], ref_grads[1][mine]),
        "dfc1": (grads[2], ref_grads[2][own]),
        "dfc2": (grads[3], ref_grads[3][own]),
    }
    for name, (got, want) in checks.items():  # scheme 3 (tests/oracle.py)
        assert_norm_relative(got, want, oracle_bound(torch.float32), msg=f"rank {rank} {routing}: {name}")

    # Bitwise reproducible across runs with communication in the loop.
    y_again, grads_again = _run_local(rank, x, ids, weights, fc1, fc2, grad, dist.group.WORLD)
    assert torch.equal(y, y_again), f"rank {rank}: y differs between runs"
    for got, again in zip(grads, grads_again):
        assert torch.equal(got, again), f"rank {rank}: a gradient differs between runs"


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_matches_oracle(world_size):
    run_distributed(_ep_body, world_size)


FP8_HIDDEN, FP8_FFN = 128, 128


def _fp8_body(rank, world_size):
    """FP8 blockwise over a gloo process group: x and dY cross as E4M3 bytes (gloo all-gathers of
    uint8) and fp32 scales; every rank's results bitwise those of EP = 1 on the whole problem, computed
    in the same process (the reference's block products are exact, so no BLAS or row grouping
    shows: tests/comm/test_fp8_emulation.py says why the comparison is exact)."""
    import torch.distributed as dist

    from megatron_mok import MoKConfig, mok_moe

    config = MoKConfig(precision="fp8_blockwise")
    gen = torch.Generator().manual_seed(2000 + world_size)
    num_experts = world_size * LOCAL_EXPERTS
    x = torch.randn(world_size, NUM_TOKENS, FP8_HIDDEN, generator=gen).bfloat16()
    ids = torch.randint(0, num_experts, (world_size, NUM_TOKENS, TOPK), generator=gen)
    ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.2, -1, ids)
    weights = torch.rand(world_size, NUM_TOKENS, TOPK, generator=gen)
    fc1 = (torch.randn(num_experts, 2 * FP8_FFN, FP8_HIDDEN, generator=gen) / FP8_HIDDEN**0.5).bfloat16()
    fc2 = (torch.randn(num_experts, FP8_HIDDEN, FP8_FFN, generator=gen) / FP8_FFN**0.5).bfloat16()
    grad = torch.randn(world_size, NUM_TOKENS, FP8_HIDDEN, generator=gen).bfloat16()

    own = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    leaves = [t.clone().requires_grad_() for t in (x[rank], weights[rank], fc1[own], fc2[own])]
    y = mok_moe(leaves[0], ids[rank], leaves[1], leaves[2], leaves[3], group=dist.group.WORLD, config=config)
    y.backward(grad[rank])

    whole = [t.clone().requires_grad_() for t in (x.flatten(0, 1), weights.flatten(0, 1), fc1, fc2)]
    y_whole = mok_moe(whole[0], ids.flatten(0, 1), whole[1], whole[2], whole[3], config=config)
    y_whole.backward(grad.flatten(0, 1))
    mine = slice(rank * NUM_TOKENS, (rank + 1) * NUM_TOKENS)
    checks = {
        "y": (y.detach(), y_whole.detach()[mine]),
        "dx": (leaves[0].grad, whole[0].grad[mine]),
        "dweights": (leaves[1].grad, whole[1].grad[mine]),
        "dfc1": (leaves[2].grad, whole[2].grad[own]),
        "dfc2": (leaves[3].grad, whole[3].grad[own]),
    }
    for name, (got, want) in checks.items():
        assert torch.equal(got, want), f"rank {rank}: FP8 {name} differs from EP = 1"


def test_expert_parallel_fp8_equals_ep1_bitwise():
    run_distributed(_fp8_body, 2)
