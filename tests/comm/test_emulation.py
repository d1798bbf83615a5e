"""EmulatedGroup: R expert-parallel ranks in one process. Its outputs and every gradient must be
bitwise those of EP = 1 on the concatenated problem (R*T tokens, R*E_local experts): a row's GEMM
and a token's fixed-order sum over k are the same arithmetic wherever they run, and the schedule
puts each expert's rows in the same order (source rank, token, k) in both. So the comparison is
exact: any difference is a wrong route, a wrong slot or a changed reduction order.

Here: the reference backend on CPU. tests/comm/test_gpu_emulation.py: the kernel backend on a Hopper GPU.
"""

from __future__ import annotations

import time
import zlib

import pytest
import torch

from megatron_mok import MoKConfig, mok_moe
from megatron_mok.emulation import EmulatedGroup, EmulatedRankTimeout

ROUTINGS = ("uniform", "skewed", "one_expert_rank0", "all_to_last_rank", "dropped")


def make_problem(num_ranks, num_tokens, hidden, ffn, local_experts, topk, routing, device, dtype, seed):
    """Every rank's inputs, stacked: x (R, T, H), ids (R, T, K) global, weights (R, T, K), fc1/fc2 of
    all R*E_local experts in global order, grad (R, T, H). Tokens carry their source rank in the
    first column so a wrong route shows up as a wrong rank's contribution."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_experts = num_ranks * local_experts
    x = torch.randn(num_ranks, num_tokens, hidden, device=device, generator=gen)
    x[..., 0] = torch.arange(num_ranks, device=device).view(-1, 1).float()
    scores = torch.rand(num_ranks, num_tokens, num_experts, device=device, generator=gen)
    if routing == "skewed":
        scores[..., : max(1, num_experts // 8)] += 2.0
    ids = scores.topk(min(topk, num_experts), dim=-1).indices
    if ids.shape[-1] < topk:
        ids = torch.cat([ids, ids[..., : topk - ids.shape[-1]]], dim=-1)
    if routing == "one_expert_rank0":
        ids.fill_(0)  # every route of every rank to expert 0 of rank 0
    elif routing == "all_to_last_rank":
        ids = (num_ranks - 1) * local_experts + ids % local_experts
    elif routing == "dropped":
        ids = torch.where(torch.rand(ids.shape, device=device, generator=gen) < 0.3, -1, ids)
    weights = torch.rand(num_ranks, num_tokens, topk, device=device, generator=gen)
    fc1 = torch.randn(num_experts, 2 * ffn, hidden, device=device, generator=gen) / hidden**0.5
    fc2 = torch.randn(num_experts, hidden, ffn, device=device, generator=gen) / ffn**0.5
    grad = torch.randn(num_ranks, num_tokens, hidden, device=device, generator=gen)
    cast = lambda t: t.to(dtype)  # noqa: E731
    return cast(x), ids, weights, cast(fc1), cast(fc2), cast(grad)


def run_emulated(group, problem, local_experts, config):
    x, ids, weights, fc1, fc2, grad = problem
    r = group.num_ranks
    leaves = (
        [x[k].clone().requires_grad_() for k in range(r)],
        [weights[k].clone().requires_grad_() for k in range(r)],
        [fc1[k * local_experts:(k + 1) * local_experts].clone().requires_grad_() for k in range(r)],
        [fc2[k * local_experts:(k + 1) * local_experts].clone().requires_grad_() for k in range(r)],
    )
    ys = group.mok_moe(leaves[0], [ids[k] for k in range(r)], leaves[1], leaves[2], leaves[3], config=config)
    torch.autograd.backward(ys, [grad[k] for k in range(r)])
    return torch.cat(ys), [torch.cat([leaf.grad for leaf in rank_leaves]) for rank_leaves in leaves]


def run_concatenated(problem, config):
    x, ids, weights, fc1, fc2, grad = problem
    r, t, h = x.shape
    leaves = [a.clone().requires_grad_() for a in (x.reshape(r * t, h), weights.reshape(r * t, -1), fc1, fc2)]
    y = mok_moe(leaves[0], ids.reshape(r * t, -1), leaves[1], leaves[2], leaves[3], config=config)
    y.backward(grad.reshape(r * t, h))
    return y.detach(), [leaf.grad for leaf in leaves]


def assert_bitwise(got, want, what):
    (y, grads), (y_want, grads_want) = got, want
    assert torch.equal(y, y_want), f"{what}: y differs from EP = 1 on the concatenated problem"
    for name, a, b in zip(("x", "topk_weights", "fc1", "fc2"), grads, grads_want):
        assert torch.equal(a, b), f"{what}: d{name} differs from EP = 1 on the concatenated problem"


# (num_ranks, num_tokens, hidden, ffn, local_experts, topk)
CPU_CASES = {
    "r2": (2, 9, 16, 8, 2, 3),
    "r4": (4, 5, 8, 4, 3, 2),
    "r4_t1": (4, 1, 8, 4, 2, 2),
    "r8": (8, 3, 8, 4, 1, 4),
}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_emulated_reference_equals_ep1_bitwise(case, routing):
    num_ranks, t, h, f, e, k = CPU_CASES[case]
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cpu", torch.float32, zlib.crc32(f"{case}/{routing}".encode()))
    got = run_emulated(EmulatedGroup(num_ranks, "cpu"), problem, e, MoKConfig())
    assert_bitwise(got, run_concatenated(problem, MoKConfig()), f"{case}/{routing}")


def test_emulated_reruns_are_bitwise_equal():
    num_ranks, t, h, f, e, k = CPU_CASES["r4"]
    problem = make_problem(num_ranks, t, h, f, e, k, "skewed", "cpu", torch.float32, 7)
    group = EmulatedGroup(num_ranks, "cpu")
    assert_bitwise(run_emulated(group, problem, e, MoKConfig()), run_emulated(group, problem, e, MoKConfig()), "rerun")


def test_a_rank_that_never_arrives_is_a_named_timeout_within_the_bound():
    group = EmulatedGroup(3, "cpu", timeout_s=0.5)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    start = time.monotonic()
    with pytest.raises(EmulatedRankTimeout, match=r"emulated rank [01]: all_gather .*within 0.5 s"):
        # Ranks 0 and 1 build their schedule; rank 2 never calls.
        group.run(lambda r: group.ranks[r].all_gather(ids), ranks=[0, 1])
    assert time.monotonic() - start < 5.0
    # The group is usable again afterwards.
    gathered = group.run(lambda r: group.ranks[r].all_gather(ids + r))
    assert all(torch.equal(g[2], ids + 2) for g in gathered)


def test_a_failing_rank_fails_every_rank_with_its_own_error_first():
    group = EmulatedGroup(2, "cpu", timeout_s=30)

    def body(rank):
        if rank == 1:
            raise ValueError("rank 1's bad input")
        return group.ranks[rank].all_gather(torch.zeros(1))

    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1's bad input"):
        group.run(body)
    assert time.monotonic() - start < 5.0  # rank 0 did not wait out the 30 s


def test_a_bad_expert_id_on_one_rank_is_the_same_value_error_on_every_rank():
    """Each rank calls mok_moe itself, as over a process group: the ids are checked after the routing
    all-gather, on the group's ids, so every rank raises alike and none is left waiting."""
    num_ranks, t, h, f, e, k = CPU_CASES["r2"]
    x, ids, weights, fc1, fc2, _ = make_problem(num_ranks, t, h, f, e, k, "uniform", "cpu", torch.float32, 3)
    ids[1, 2, 0] = num_ranks * e  # one past the last expert, on rank 1 only
    group = EmulatedGroup(num_ranks, "cpu", timeout_s=30)

    def body(rank):
        try:
            mok_moe(x[rank], ids[rank], weights[rank], fc1[rank * e:(rank + 1) * e], fc2[rank * e:(rank + 1) * e], group=group.ranks[rank])
        except ValueError as error:
            return str(error)
        return "no error"

    start = time.monotonic()
    messages = group.run(body)
    assert time.monotonic() - start < 5.0  # nobody waited out the rendezvous
    for message in messages:
        assert f"expert id {num_ranks * e} on rank 1" in message, messages


@pytest.mark.parametrize("what", ["num_tokens", "topk"])
def test_ranks_calling_with_different_shapes_get_the_same_value_error(what):
    """Each rank calls mok_moe itself, as over a process group, one with a different num_tokens (or
    topk): every rank raises the shape agreement's ValueError, none hangs in a collective."""
    num_ranks, t, h, f, e, k = CPU_CASES["r2"]
    x, ids, weights, fc1, fc2, _ = make_problem(num_ranks, t, h, f, e, k, "uniform", "cpu", torch.float32, 4)
    inputs = [[x[r], ids[r], weights[r]] for r in range(num_ranks)]
    inputs[1] = [a[:-1] for a in inputs[1]] if what == "num_tokens" else [x[1], ids[1][:, :1], weights[1][:, :1]]
    group = EmulatedGroup(num_ranks, "cpu", timeout_s=30)

    def body(rank):
        try:
            mok_moe(*inputs[rank], fc1[rank * e:(rank + 1) * e], fc2[rank * e:(rank + 1) * e], group=group.ranks[rank])
        except ValueError as error:
            return str(error)
        return "no error"

    start = time.monotonic()
    messages = group.run(body)
    assert time.monotonic() - start < 5.0
    assert all("called with different shapes" in m for m in messages), messages


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a["xs"].pop(), "xs must be a list of 2 tensors"),
        (lambda a: a["xs"].__setitem__(1, a["xs"][1][:-1]), "xs: every rank must pass the same shape"),
        (lambda a: a["topk_ids"].__setitem__(1, a["topk_ids"][1][:, :1]), "topk_ids: every rank must pass the same shape"),
    ],
    ids=["rank_missing", "different_num_tokens", "different_topk"],
)
def test_bad_group_input_is_a_value_error_before_any_work(change, message):
    num_ranks, t, h, f, e, k = CPU_CASES["r2"]
    x, ids, weights, fc1, fc2, _ = make_problem(num_ranks, t, h, f, e, k, "uniform", "cpu", torch.float32, 1)
    args = dict(
        xs=[x[0], x[1]], topk_ids=[ids[0], ids[1]], topk_weights=[weights[0], weights[1]],
        fc1s=[fc1[:e], fc1[e:]], fc2s=[fc2[:e], fc2[e:]],
    )
    change(args)
    with pytest.raises(ValueError, match=message):
        EmulatedGroup(num_ranks, "cpu").mok_moe(**args)


def test_symmetric_exchange_where_it_cannot_run_is_a_named_error():
    num_ranks, t, h, f, e, k = CPU_CASES["r2"]
    x, ids, weights, fc1, fc2, _ = make_problem(1, t, h, f, e, k, "uniform", "cpu", torch.float32, 2)
    with pytest.raises(ValueError, match="exchange='symmetric' cannot run over this group: the group's tensors are on cpu"):
        mok_moe(x[0], ids[0], weights[0], fc1, fc2, config=MoKConfig(exchange="symmetric"))
    with pytest.raises(ValueError, match="exchange='symmetric' needs a CUDA device"):
        EmulatedGroup(2, "cpu", exchange="symmetric")


def test_config_exchange_must_be_known():
    with pytest.raises(ValueError, match="MoKConfig.exchange must be one of"):
        MoKConfig(exchange="nccl")
