"""The schedule is the documented function of the gathered routing: compared exactly."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import MoKConfig, build_schedule, forward, backward, recompute_forward_context
from megatron_mok.schedule import build_schedule_from_gathered, schedule_capacity
from oracle import assert_norm_relative, oracle_bound


def expected_schedule(ids_all: torch.Tensor, rank: int, num_local: int, align: int):
    """Plain-Python statement of the order: local expert, then source rank, token, k."""
    num_ranks, num_tokens, topk = ids_all.shape
    slots, offsets = [], [0]
    for local in range(num_local):
        segment = [
            (src * num_tokens + t) * topk + k
            for src in range(num_ranks)
            for t in range(num_tokens)
            for k in range(topk)
            if int(ids_all[src, t, k]) == rank * num_local + local
        ]
        pad = (-len(segment)) % align
        slots += segment + [-1] * pad
        offsets.append(len(slots))
    return slots, offsets


CASES = [
    # (num_ranks, num_tokens, topk, num_local_experts, alignment)
    (1, 1, 1, 1, 1),
    (1, 9, 3, 4, 1),
    (2, 7, 2, 3, 1),
    (4, 5, 4, 2, 1),
    (2, 7, 2, 3, 4),
    (3, 6, 3, 2, 8),
]


@pytest.mark.parametrize("routing", ["uniform", "dropped", "one_expert", "all_dropped"])
@pytest.mark.parametrize("num_ranks,num_tokens,topk,num_local,align", CASES)
def test_schedule_matches_documented_order(num_ranks, num_tokens, topk, num_local, align, routing):
    gen = torch.Generator().manual_seed(num_ranks * 100 + num_tokens)
    num_experts = num_ranks * num_local
    ids_all = torch.randint(0, num_experts, (num_ranks, num_tokens, topk), generator=gen)
    if routing == "dropped":
        ids_all = torch.where(torch.rand(ids_all.shape, generator=gen) < 0.3, -1, ids_all)
    elif routing == "one_expert":
        ids_all.fill_(num_experts - 1)
    elif routing == "all_dropped":
        ids_all.fill_(-1)
    for rank in range(num_ranks):
        schedule = build_schedule_from_gathered(ids_all, rank=rank, num_local_experts=num_local, segment_alignment=align)
        slots, offsets = expected_schedule(ids_all, rank, num_local, align)
        capacity = schedule_capacity(ids_all.numel(), num_local, align)
        assert schedule.capacity == capacity
        assert schedule.slot_to_route[: len(slots)].tolist() == slots
        assert (schedule.slot_to_route[len(slots):] == -1).all()
        assert schedule.expert_offsets.tolist() == offsets
        assert schedule.expert_offsets.dtype == torch.int32
        counts = [sum(1 for s in slots[offsets[e]:offsets[e + 1]] if s >= 0) for e in range(num_local)]
        assert schedule.expert_counts.tolist() == counts
        # route_to_slot inverts slot_to_route for owned routes and points elsewhere at `capacity`.
        expected_inverse = [capacity] * ids_all.numel()
        for slot, route in enumerate(slots):
            if route >= 0:
                expected_inverse[route] = slot
        assert schedule.route_to_slot.tolist() == expected_inverse


def _inputs(seed=0, t=11, h=16, f=8, e=4, k=3):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, h, generator=gen),
        torch.randint(-1, e, (t, k), generator=gen),
        torch.rand(t, k, generator=gen),
        torch.randn(e, 2 * f, h, generator=gen) / 4,
        torch.randn(e, h, f, generator=gen) / 3,
    )


def test_functional_matches_autograd_and_recompute_is_identical():
    from megatron_mok import mok_moe

    x, ids, w, fc1, fc2 = _inputs()
    grad = torch.randn_like(x)
    schedule = build_schedule(ids, num_local_experts=fc1.shape[0])
    y, ctx = forward(x, ids, w, fc1, fc2, schedule=schedule)
    grads = backward(ctx, grad, fc1, fc2)

    leaves = [t.clone().requires_grad_() for t in (x, w, fc1, fc2)]
    y_auto = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    y_auto.backward(grad)
    assert torch.equal(y, y_auto)
    for got, leaf in zip((grads.x, grads.topk_weights, grads.fc1, grads.fc2), leaves):
        assert torch.equal(got, leaf.grad)

    ctx2 = recompute_forward_context(x, ids, w, fc1, fc2)
    for a, b in zip(ctx.tensors(), ctx2.tensors()):
        assert torch.equal(a, b)
    grads2 = backward(ctx2, grad, fc1, fc2)
    assert torch.equal(grads.x, grads2.x) and torch.equal(grads.fc1, grads2.fc1)


def test_aligned_schedule_gives_the_same_result():
    x, ids, w, fc1, fc2 = _inputs(seed=4)
    y1, _ = forward(x, ids, w, fc1, fc2)
    y8, ctx = forward(x, ids, w, fc1, fc2, config=MoKConfig(segment_alignment=8))
    assert (ctx.schedule.expert_offsets % 8 == 0).all()
    # The same per-row arithmetic in GEMMs of other row counts: two fp32 evaluations (scheme 3, paths=2).
    assert_norm_relative(y8, y1, oracle_bound(torch.float32, paths=2), msg="padding rows must not change y")


def test_schedule_for_other_routing_is_rejected():
    x, ids, w, fc1, fc2 = _inputs()
    schedule = build_schedule(ids[:5], num_local_experts=fc1.shape[0])
    with pytest.raises(ValueError, match="schedule was built for"):
        forward(x, ids, w, fc1, fc2, schedule=schedule)


def test_backward_rejects_wrong_grad_shape():
    x, ids, w, fc1, fc2 = _inputs()
    _, ctx = forward(x, ids, w, fc1, fc2)
    with pytest.raises(ValueError, match="grad_y must be"):
        backward(ctx, torch.randn(3, x.shape[1]), fc1, fc2)
