"""Which implementation runs a MoK call.

The reference backend runs anywhere. The fused Hopper kernel arrives with the CUDA extension;
until it is built, `backend="kernel"` is an error and `backend="auto"` runs the reference.
"""

from __future__ import annotations

import torch

from megatron_mok.config import MoKConfig


def resolve_backend(config: MoKConfig, x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> str:
    """Returns "reference" or "kernel" for this call, or raises where "kernel" cannot run."""
    if config.backend == "reference":
        return "reference"
    if config.backend == "kernel":
        if not x.is_cuda:
            raise ValueError(f"MoKConfig.backend='kernel' needs CUDA tensors; x is on {x.device}")
        raise RuntimeError(
            "MoKConfig.backend='kernel': this build of megatron_mok has no fused MoE kernel yet; "
            "use backend='reference' or 'auto'"
        )
    # "auto": the reference is the only implementation so far.
    return "reference"
