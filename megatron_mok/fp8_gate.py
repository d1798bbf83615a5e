"""The gate of the FP8 paths not yet verified on a GPU (the kernel backend's FP8 stages, FP8 rows
through the in-kernel exchange): one environment variable, read where each path is chosen. A
module of its own, below every other: the backends and the exchange both read it."""

from __future__ import annotations

import os
from typing import Optional

# The FP8 paths not yet verified on a GPU (the kernel backend's FP8 stages, FP8 rows through the
# in-kernel exchange) run only where the environment sets this to 1 (their GPU tests do).
UNVERIFIED_FP8_KERNELS_ENV = "MEGATRON_MOK_UNVERIFIED_FP8_KERNELS"


def fp8_kernels_unlocked() -> bool:
    """Whether the environment runs the FP8 paths not yet verified on a GPU."""
    return os.environ.get(UNVERIFIED_FP8_KERNELS_ENV) == "1"


def fp8_kernels_gate_reason(what: str) -> Optional[str]:
    """None where the gate is open, else why `what` (an unverified FP8 path) does not run."""
    if fp8_kernels_unlocked():
        return None
    return (f"{what} is not verified on a GPU yet; it runs only with the environment variable "
            f"{UNVERIFIED_FP8_KERNELS_ENV}=1 (MoKConfig.exchange='auto' or 'collective' moves FP8 rows today)")
