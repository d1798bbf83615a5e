"""The frozen configuration of a MoK layer call."""

from __future__ import annotations

import dataclasses
from typing import Literal

Backend = Literal["auto", "reference", "kernel"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "kernel")


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """How `mok_moe` and the functional layer run.

    Attributes:
        backend: "reference" runs the exact PyTorch implementation; "kernel" the CUDA kernel
            backend for Hopper (an error where it cannot run, see backends.py); "auto" picks the
            kernel where it can run and the reference elsewhere.
        segment_alignment: every local expert's segment of the schedule is padded to a
            multiple of this many rows (padding rows are marked -1). 1 for the reference;
            kernels set their M tile so a tile never straddles two experts.
        check_expert_ids: validate that every expert id lies in [-1, num_experts). On CPU
            tensors a bad id raises ValueError; on CUDA the check is a device-side assert
            (`torch._assert_async`), because a host-side check would synchronize.
    """

    backend: Backend = "auto"
    segment_alignment: int = 1
    check_expert_ids: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"MoKConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.segment_alignment, int) or self.segment_alignment < 1:
            raise ValueError(
                f"MoKConfig.segment_alignment must be a positive int, got {self.segment_alignment!r}"
            )
