"""Checks the ops' argument validation shares (the wrappers raise ValueError before a kernel runs)."""

from __future__ import annotations

import torch


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of two tensors (each contiguous or not) share an address range."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0) + 1
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1
