"""The `mok` token dispatcher: Megatron's six-phase contract around one fused call.

MoK dispatches, computes and combines in one operation, so the dispatch phases only reshape the
tokens and turn the router's dense output into top-k form; the MoK layer runs `mok_moe` in its
`routed_experts_compute`, and the combine phases restore the input shape.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mok.megatron.routing import routing_map_to_topk


class MoKTokenDispatcher(MoETokenDispatcher):
    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.hidden_shape: Optional[torch.Size] = None
        self.topk_ids: Optional[torch.Tensor] = None  # (num_tokens, topk) int64

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Returns tokens (num_tokens, hidden) and topk_weights (num_tokens, topk) float32."""
        self.hidden_shape = tokens.shape
        tokens = tokens.reshape(-1, tokens.shape[-1])
        self.topk_ids, topk_weights = routing_map_to_topk(probs, routing_map, self.config.moe_router_topk)
        return tokens, topk_weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        # The pull dispatch happens inside mok_moe.
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, None, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The push combine happened inside mok_moe.
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)
