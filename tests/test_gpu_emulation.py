"""EmulatedGroup with the kernel backend on a Hopper GPU: every rank's outputs and gradients bitwise
those of the EP = 1 kernel on the concatenated problem, same expert-GEMM family (why exact: see
tests/test_emulation.py)."""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.emulation import EmulatedGroup
from cuda_checks import NEEDS_HOPPER_KERNELS
from test_emulation import ROUTINGS, assert_bitwise, make_problem, run_concatenated, run_emulated

pytestmark = NEEDS_HOPPER_KERNELS

# (num_ranks, num_tokens, hidden, ffn, local_experts, topk)
GPU_CASES = {
    "r2": (2, 256, 512, 256, 4, 4),
    "r4_odd_tokens": (4, 100, 256, 128, 3, 8),
    "r8": (8, 64, 512, 256, 2, 8),
    "r8_t1": (8, 1, 256, 128, 2, 2),
}
GPU_CONFIGS = {
    "auto": MoKConfig(backend="kernel"),
    "sm90_ring3": MoKConfig(backend="kernel", expert_gemm="sm90", dispatch_ring_minibatches=3),
}


@pytest.mark.parametrize("config_name", list(GPU_CONFIGS))
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_emulated_kernel_equals_ep1_kernel_bitwise(case, routing, config_name):
    num_ranks, t, h, f, e, k = GPU_CASES[case]
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16, zlib.crc32(f"{case}/{routing}".encode()))
    config = GPU_CONFIGS[config_name]
    got = run_emulated(EmulatedGroup(num_ranks, "cuda"), problem, e, config)
    torch.cuda.synchronize()
    assert_bitwise(got, run_concatenated(problem, config), f"{case}/{routing}/{config_name}")
