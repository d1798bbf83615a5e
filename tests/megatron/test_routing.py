"""Megatron's dense router output -> MoK's top-k form, compared exactly."""

from __future__ import annotations

import torch

from megatron_mok.megatron.routing import routing_map_to_topk


def test_topk_form_is_exact_including_capacity_drops():
    num_experts, topk = 6, 3
    routing_map = torch.tensor(
        [
            [0, 1, 0, 1, 1, 0],  # full row
            [1, 0, 0, 0, 0, 1],  # one route dropped by a capacity factor
            [0, 0, 0, 0, 0, 0],  # every route dropped
            [0, 0, 1, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    probs = torch.rand(4, num_experts) * routing_map
    probs.requires_grad_()
    ids, weights = routing_map_to_topk(probs, routing_map, topk)
    assert ids.tolist() == [[1, 3, 4], [0, 5, -1], [-1, -1, -1], [2, -1, -1]]
    assert weights.dtype == torch.float32
    for row, experts in enumerate(ids.tolist()):
        for k, expert in enumerate(experts):
            want = probs[row, expert].item() if expert >= 0 else 0.0
            assert weights[row, k].item() == want
    weights.sum().backward()
    assert torch.equal(probs.grad, routing_map.float())


def test_bf16_probs_become_fp32_weights():
    routing_map = torch.zeros(5, 4, dtype=torch.bool)
    routing_map[:, 1] = True
    routing_map[:, 3] = True
    probs = (torch.rand(5, 4) * routing_map).bfloat16()
    ids, weights = routing_map_to_topk(probs, routing_map, 2)
    assert (ids == torch.tensor([1, 3])).all()
    assert weights.dtype == torch.float32
    assert torch.equal(weights, probs[:, [1, 3]].float())
