"""Megatron's router output -> MoK's top-k form, without a host synchronization."""

from __future__ import annotations

import torch


def routing_map_to_topk(
    probs: torch.Tensor, routing_map: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Converts Megatron's dense routing to top-k ids and weights.

    Args:
        probs: (num_tokens, num_experts) routing probabilities (zero where not routed).
        routing_map: (num_tokens, num_experts) bool; a row holds at most `topk` True entries
            (fewer when a capacity factor dropped routes).
        topk: the router's top-k.
    Returns:
        topk_ids (num_tokens, topk) int64: the routed experts in ascending id order, -1 padded;
        topk_weights (num_tokens, topk) float32: their probabilities (0 where -1), differentiable
        with respect to `probs`.
    """
    num_experts = routing_map.shape[1]
    # Routed experts score num_experts - id (> 0), so topk returns them lowest id first and
    # unrouted experts (score 0) only where a row has fewer than topk routes.
    expert_ids = torch.arange(num_experts, device=routing_map.device, dtype=torch.int64)
    score = torch.where(routing_map, num_experts - expert_ids, 0)
    top_score, top_ids = torch.topk(score, k=topk, dim=1, sorted=True)
    routed = top_score > 0
    topk_ids = torch.where(routed, top_ids, -1)
    gathered = probs.gather(1, top_ids).float()
    topk_weights = torch.where(routed, gathered, torch.zeros((), dtype=torch.float32, device=probs.device))
    return topk_ids, topk_weights
