"""Argument checks for the MoK layer: every error names the argument, before any work runs."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok.config import MoKConfig
from megatron_mok.limits import FP8_BLOCK
from megatron_mok.schedule import check_expert_id_range

ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_config_and_input(config: object, x: object) -> None:
    """The checks a pass needs before it reads config's fields or x's device (resolving the group)."""
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig, got {type(config).__name__}")
    _require_tensor("x", x)


def _require_dim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")


def _require_contiguous(name: str, tensor: torch.Tensor) -> None:
    # The kernels address rows and expert matrices with dense strides (TMA descriptors).
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _require_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but x is on {device}")


def validate_moe_inputs(
    x: object,
    topk_ids: object,
    topk_weights: object,
    fc1: object,
    fc2: object,
    *,
    num_ranks: int,
    config: MoKConfig,
    shared_fc1: Optional[object] = None,
    shared_fc2: Optional[object] = None,
) -> None:
    """Checks the arguments of `mok_moe` (see its docstring for the layouts)."""
    require_config_and_input(config, x)
    topk_ids = _require_tensor("topk_ids", topk_ids)
    topk_weights = _require_tensor("topk_weights", topk_weights)
    fc1 = _require_tensor("fc1", fc1)
    fc2 = _require_tensor("fc2", fc2)

    _require_dim("x", x, 2, "(num_tokens, hidden)")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    _require_contiguous("x", x)
    num_tokens, hidden = x.shape
    if hidden == 0:
        raise ValueError("x must have a non-empty hidden dimension")

    _require_dim("topk_ids", topk_ids, 2, "(num_tokens, topk)")
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids has {topk_ids.shape[0]} rows but x has {num_tokens} tokens"
        )
    if topk_ids.shape[1] == 0:
        raise ValueError("topk_ids must have at least one column (topk >= 1)")
    _require_device("topk_ids", topk_ids, x.device)

    _require_dim("topk_weights", topk_weights, 2, "(num_tokens, topk)")
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights has shape {tuple(topk_weights.shape)} but topk_ids has "
            f"{tuple(topk_ids.shape)}"
        )
    _require_device("topk_weights", topk_weights, x.device)

    _require_dim("fc1", fc1, 3, "(num_local_experts, 2 * ffn_hidden, hidden)")
    _require_dim("fc2", fc2, 3, "(num_local_experts, hidden, ffn_hidden)")
    for name, weight in (("fc1", fc1), ("fc2", fc2)):
        if weight.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {weight.dtype}")
        _require_contiguous(name, weight)
        _require_device(name, weight, x.device)
    num_local_experts = fc1.shape[0]
    if num_local_experts == 0:
        raise ValueError("fc1 must hold at least one local expert")
    if fc1.shape[2] != hidden:
        raise ValueError(f"fc1 has input size {fc1.shape[2]} but x has hidden size {hidden}")
    if fc1.shape[1] % 2 != 0 or fc1.shape[1] == 0:
        raise ValueError(
            f"fc1 must stack gate and up rows (2 * ffn_hidden), got {fc1.shape[1]} rows"
        )
    ffn_hidden = fc1.shape[1] // 2
    if tuple(fc2.shape) != (num_local_experts, hidden, ffn_hidden):
        raise ValueError(
            f"fc2 must be (num_local_experts, hidden, ffn_hidden) = "
            f"{(num_local_experts, hidden, ffn_hidden)}, got {tuple(fc2.shape)}"
        )

    if config.precision == "fp8_blockwise":
        # The recipe's 1x128 and 128x128 blocks tile H and F exactly (docs/design.md §12); never a
        # silent bf16 run in its place.
        for name, size in (("x's hidden size (H)", hidden), ("fc1's ffn_hidden (F, fc1.shape[1] // 2)", ffn_hidden)):
            if size % FP8_BLOCK:
                raise ValueError(
                    f"{name} is {size}; MoKConfig.precision='fp8_blockwise' needs a multiple of {FP8_BLOCK}"
                )

    if (shared_fc1 is None) != (shared_fc2 is None):
        raise ValueError("shared_fc1 and shared_fc2 must be given together")
    if shared_fc1 is not None:
        shared_fc1 = _require_tensor("shared_fc1", shared_fc1)
        shared_fc2 = _require_tensor("shared_fc2", shared_fc2)
        _require_dim("shared_fc1", shared_fc1, 2, "(2 * shared_ffn_hidden, hidden)")
        _require_dim("shared_fc2", shared_fc2, 2, "(hidden, shared_ffn_hidden)")
        if shared_fc1.shape[1] != hidden or shared_fc1.shape[0] % 2 != 0 or shared_fc1.shape[0] == 0:
            raise ValueError(
                f"shared_fc1 must be (2 * shared_ffn_hidden, {hidden}), got {tuple(shared_fc1.shape)}"
            )
        if tuple(shared_fc2.shape) != (hidden, shared_fc1.shape[0] // 2):
            raise ValueError(
                f"shared_fc2 must be {(hidden, shared_fc1.shape[0] // 2)}, got {tuple(shared_fc2.shape)}"
            )
        for name, weight in (("shared_fc1", shared_fc1), ("shared_fc2", shared_fc2)):
            if weight.dtype != x.dtype:
                raise TypeError(f"{name} must have x's dtype {x.dtype}, got {weight.dtype}")
            _require_device(name, weight, x.device)

    # On CPU a bad id is a ValueError here, before any work, on one rank. With several ranks the
    # schedule build checks the group's gathered ids instead (build_schedule_from_gathered), so every
    # rank raises alike after the routing all-gather: a rank that raised here would leave the others
    # waiting in it. On CUDA the check runs where the ids are read anyway: inside the schedule kernel,
    # so it adds no launches or host time before the layer's first large kernel.
    if config.check_expert_ids and topk_ids.device.type == "cpu" and num_ranks == 1:
        check_expert_id_range(topk_ids, num_local_experts * num_ranks)
