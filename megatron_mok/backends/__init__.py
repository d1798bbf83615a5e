"""Backends: the stage contract (stages.py), the reference (reference.py; its FP8 blockwise recipe in
reference_fp8.py), the CUDA kernels (kernel.py; FP8 blockwise in kernel_fp8.py) with their tuning
table (tuning.py), and here the choice of which one runs a call.

The kernel backend (either MoKConfig.precision: "bf16", or "fp8_blockwise" through kernel_fp8.py)
needs CUDA tensors on a Hopper GPU (the extension is built for sm_90a), the extension loaded, bf16
activations, and hidden and ffn sizes that are multiples of 8 (16-byte rows for the grouped GEMM;
FP8 needs multiples of 128, a ValueError of the input checks before any backend is chosen).
`backend="kernel"` raises where these fail; `backend="auto"` then runs the reference, with a
one-time warning on CUDA tensors (on CPU the reference is the expected path).
Any expert-parallel size: the stages are per rank, and what crosses ranks is the exchange's
(comm/exchange.py), the same for both backends.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from megatron_mok.backends.stages import Stages
from megatron_mok.quantization import Fp8Recipe

_warned: set[str] = set()


def kernel_unsupported_reason(x: torch.Tensor, fc1: torch.Tensor, precision: str = "bf16") -> Optional[str]:
    """None if the kernel backend can run this call (precision: MoKConfig.precision, either of
    config.PRECISIONS), else why not."""
    if not x.is_cuda:
        return f"x is on {x.device}, the kernel needs CUDA tensors"
    from megatron_mok.ops import extension_error

    error = extension_error()
    if error is not None:
        return f"the megatron_mok CUDA extension is not available ({error})"
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return f"the kernels are built for sm_90a (Hopper); this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}"
    if x.dtype != torch.bfloat16:
        return f"the kernel runs bfloat16 only, x is {x.dtype}"
    hidden, ffn = x.shape[1], fc1.shape[1] // 2
    if hidden % 8 or ffn % 8:
        return f"hidden ({hidden}) and ffn_hidden ({ffn}) must be multiples of 8 for the kernel"
    return None


def resolve_backend(backend: str, x: torch.Tensor, fc1: torch.Tensor, precision: str = "bf16") -> str:
    """Returns "reference" or "kernel" for this call of MoKConfig.backend `backend` ("auto",
    "reference" or "kernel") at MoKConfig.precision `precision`, or raises where "kernel" cannot run.
    (The backends read the config's fields, never the config: config.py sits above them and imports
    their tuning table.)"""
    if backend == "reference":
        return "reference"
    reason = kernel_unsupported_reason(x, fc1, precision)
    if reason is None:
        return "kernel"
    if backend == "kernel":
        raise ValueError(f"MoKConfig.backend='kernel' cannot run this call: {reason}")
    if x.is_cuda and reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"megatron_mok: running the reference backend because {reason}", stacklevel=3)
    return "reference"


def stages_for(backend: str, expert_gemm: str = "auto", fp8: Optional[Fp8Recipe] = None) -> Stages:
    """The stage table of a backend; expert_gemm (MoKConfig.expert_gemm) picks the kernel backend's
    expert GEMMs; fp8 (MoKConfig.fp8_recipe()) the FP8 blockwise recipe's stages, None for bf16. The
    tables import lazily: the reference needs no extension."""
    if backend == "reference":
        if fp8 is not None:
            from megatron_mok.backends.reference_fp8 import reference_fp8_stages

            return reference_fp8_stages(fp8)
        from megatron_mok.backends.reference import REFERENCE_STAGES

        return REFERENCE_STAGES
    if backend == "kernel":
        from megatron_mok.backends.kernel import KERNEL_STAGES

        if fp8 is not None:
            from megatron_mok.backends.kernel_fp8 import kernel_fp8_stages

            return kernel_fp8_stages(fp8, expert_gemm)
        if expert_gemm not in KERNEL_STAGES:
            raise ValueError(f"unknown expert_gemm {expert_gemm!r}, expected one of {tuple(KERNEL_STAGES)}")
        return KERNEL_STAGES[expert_gemm]
    raise ValueError(f"unknown backend {backend!r}")
