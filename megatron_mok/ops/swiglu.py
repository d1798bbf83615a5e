"""SwiGLU over the schedule's rows (csrc/moe/swiglu_sm90.cuh). References: reference.swiglu,
reference.swiglu_backward."""

from __future__ import annotations

import torch

from megatron_mok.ops.extension import register_fake


@register_fake("swiglu_forward")
def _swiglu_forward_fake(gate_up, offsets):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@register_fake("swiglu_backward")
def _swiglu_backward_fake(gate_up, grad_act, offsets):
    return torch.empty_like(gate_up)


def swiglu_forward(gate_up: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(rows, F): silu(gate) * up, zero past offsets[-1]."""
    return torch.ops.megatron_mok.swiglu_forward(gate_up, offsets)


def swiglu_backward(gate_up: torch.Tensor, grad_act: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(rows, 2F): d gate_up, zero past offsets[-1]."""
    return torch.ops.megatron_mok.swiglu_backward(gate_up, grad_act, offsets)
