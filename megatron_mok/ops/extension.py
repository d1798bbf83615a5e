"""Loading the CUDA extension (`megatron_mok._C`, csrc/bindings/) and what it reports about itself.

The extension registers the `torch.ops.megatron_mok.*` CUDA implementations and their schemas; each
op module of this package registers the op's fake (meta) implementation beside its wrapper, so
torch.compile and meta tensors get output shapes without running anything.
"""

from __future__ import annotations

import atexit
import sys
from typing import Callable, Optional

import torch

_LOAD_ERROR: Optional[str] = None
try:
    from megatron_mok import _C  # noqa: F401  (registers torch.ops.megatron_mok.*)
except ImportError as error:  # no CUDA toolchain at install time, or a CPU-only build
    _LOAD_ERROR = f"{type(error).__name__}: {error}"


def extension_error() -> Optional[str]:
    """None when the CUDA extension is loaded, else why it is not."""
    return _LOAD_ERROR


def register_fake(name: str) -> Callable:
    """torch.library.register_fake for megatron_mok::name where the extension defines the op; a
    no-op decorator otherwise (there is no op to give a shape to: no extension, or a build older
    than the op, whose call then fails as the op's absence)."""
    if _LOAD_ERROR is not None or not hasattr(torch.ops.megatron_mok, name):
        return lambda fn: fn
    return torch.library.register_fake(f"megatron_mok::{name}")


def last_failure() -> Optional[str]:
    """What a kernel recorded before it trapped in this process, or None: which bounded wait timed
    out (the kernel, the wait, the block, and the peer rank / layer call where there is one) or which
    in-kernel check failed (the schedule's expert ids). The names come from the extension
    (csrc/common/failure_record.h), the one place that numbers the waits."""
    if _LOAD_ERROR is not None:
        return None
    message = torch.ops.megatron_mok.last_failure()
    return message or None


def compiled_limits() -> Optional[dict[str, int]]:
    """The limits the loaded extension was compiled with (megatron_mok/limits.py COMPILED, handed to
    nvcc by setup.py), or None without the extension."""
    if _LOAD_ERROR is not None:
        return None
    names = torch.ops.megatron_mok.compiled_limit_names()
    values = torch.ops.megatron_mok.compiled_limits()
    return dict(zip(names, values))


def _report_failure_at_exit() -> None:
    message = last_failure()
    if message is not None:
        print(f"megatron_mok: a kernel trapped: {message}", file=sys.stderr)


if _LOAD_ERROR is None:
    atexit.register(_report_failure_at_exit)
