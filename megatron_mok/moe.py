"""`mok_moe`: the MoK layer as a differentiable function."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_mok import functional
from megatron_mok.config import MoKConfig
from megatron_mok.validation import validate_moe_inputs
from megatron_mok.comm import ProcessGroup, get_expert_parallel_group


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, fc1, fc2, group, config):
        y, fctx = functional.forward(
            x, topk_ids, topk_weights, fc1, fc2, group=group, config=config, validate=False
        )
        # Tensors go through save_for_backward so saved-tensor hooks (offloading) see them.
        ctx.save_for_backward(fc1, fc2, *fctx.tensors())
        ctx.fctx = fctx.with_tensors(tuple(None for _ in fctx.TENSOR_FIELDS))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if ctx.fctx is None:
            raise RuntimeError(
                "mok_moe: backward through this call began already; backward twice (retain_graph=True), or again "
                "after a backward that failed, is not supported: backward frees the call's saved activations as "
                "it goes"
            )
        fc1, fc2, *saved = ctx.saved_tensors
        fctx = ctx.fctx.with_tensors(tuple(saved))
        ctx.fctx = None  # (before anything is freed, so that no later backward reads what was)
        need_x, _, need_w, need_fc1, need_fc2, _, _ = ctx.needs_input_grad
        grads = functional.backward(
            fctx,
            grad_y,
            fc1,
            fc2,
            need_input_grads=need_x or need_w,
            need_weight_grads=need_fc1 or need_fc2,
            # Held by nothing but the saved tensors; under create_graph (grad mode on here) the
            # reference's backward ops save gate/up and act for the next backward: kept then.
            release_saved=not torch.is_grad_enabled(),
        )
        return grads.x, None, grads.topk_weights, grads.fc1, grads.fc2, None, None


def shared_expert(x: torch.Tensor, shared_fc1: torch.Tensor, shared_fc2: torch.Tensor) -> torch.Tensor:
    """The shared expert: shared_fc2 @ (silu(gate x) * (up x)), SwiGLU in fp32. Returns x.dtype."""
    gate_up = x @ shared_fc1.t()
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype) @ shared_fc2.t()


def mok_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    *,
    group: Optional[ProcessGroup] = None,
    config: MoKConfig = MoKConfig(),
    shared_fc1: Optional[torch.Tensor] = None,
    shared_fc2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The MoK MoE layer.

    y[t] = sum over k of topk_weights[t, k] * fc2_e @ (silu(gate_e x_t) * (up_e x_t)), e =
    topk_ids[t, k], skipping -1, summed in ascending k in fp32 and returned in x.dtype; plus the
    shared expert when given. Differentiable in x, topk_weights, fc1, fc2 and the shared weights.

    Args:
        x: (num_tokens, hidden) bf16/fp32, contiguous; every rank of `group` passes the same
            num_tokens.
        topk_ids: (num_tokens, topk) int32/int64 global expert ids, -1 for a dropped route.
        topk_weights: (num_tokens, topk) float32.
        fc1: (num_local_experts, 2 * ffn_hidden, hidden), gate rows first (Megatron's layout).
        fc2: (num_local_experts, hidden, ffn_hidden).
        group: the expert-parallel process group (None = one rank); rank r owns global experts
            [r * num_local_experts, (r + 1) * num_local_experts).
        shared_fc1: (2 * shared_ffn_hidden, hidden), optional shared expert, gate rows first.
        shared_fc2: (hidden, shared_ffn_hidden).
    Returns:
        (num_tokens, hidden) in x.dtype.
    """
    # Resolved once: functional.forward takes the ExpertParallelGroup as it is.
    ep_group = get_expert_parallel_group(group, x.device) if isinstance(x, torch.Tensor) else None
    validate_moe_inputs(
        x, topk_ids, topk_weights, fc1, fc2,
        num_ranks=ep_group.num_ranks if ep_group is not None else 1, config=config,
        shared_fc1=shared_fc1, shared_fc2=shared_fc2,
    )
    y = _RoutedExperts.apply(x, topk_ids, topk_weights, fc1, fc2, ep_group, config)
    if shared_fc1 is not None:
        y = y + shared_expert(x, shared_fc1, shared_fc2)
    return y
