"""Where a CUDA toolchain and a CUDA build of torch exist, the extension must have been built
(CI has nvcc but no GPU: a kernel that does not compile for sm_90a fails here)."""

from __future__ import annotations

import shutil

import pytest
import torch


@pytest.mark.skipif(shutil.which("nvcc") is None or torch.version.cuda is None, reason="no CUDA toolchain")
def test_cuda_extension_is_built_and_registers_every_op():
    from megatron_mok.ops import extension_error

    assert extension_error() is None, f"megatron_mok._C did not load: {extension_error()}"
    for name in ("build_schedule", "dispatch_rows", "combine", "pull_grad_rows", "route_weight_grads", "swiglu_forward", "swiglu_backward"):
        assert hasattr(torch.ops.megatron_mok, name), name


def test_kernel_backend_is_not_chosen_for_cpu_tensors():
    from megatron_mok.backends import kernel_unsupported_reason

    reason = kernel_unsupported_reason(torch.zeros(2, 8), torch.zeros(1, 16, 8))
    assert reason is not None and "CUDA" in reason
