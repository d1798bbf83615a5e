"""`MoKMoELayer` from our spec over a process group of R = 2, 4, 8 processes on one GPU, against the
one-rank module on the same tokens and weights.

Megatron's model-parallel state is initialized over a gloo world group (NCCL refuses two ranks on one
GPU), so its expert-parallel group is gloo too; the layer's tensors are on the GPU and its exchange is
the in-kernel one over CUDA-IPC regions (comm/cuda_ipc.py). The one-rank module runs in its own
process (world size 1) on the R ranks' tokens concatenated and saves its weights, inputs and results;
then each of the R ranks loads the router and its experts' slice, runs its tokens, and compares.

What must match: the routing exactly (top-k ids); y, dx, dfc1 and dfc2 bitwise where the router's
logits come out bitwise alike (a (T, H) and an (R*T, H) fp32 GEMM give the same row sums unless cuBLAS
picks a kernel with another reduction order), else within one bf16 rounding, 2^-8 relative to the
norm: every one of these is a bf16 rounding of an fp32 value built from those logits' probabilities,
and a last-ulp change of a probability moves it by at most one rounding. The router's weight gradient
is the R ranks' partial sums added, against one sum over all R*T tokens: each partial and the whole
is rounded once to the parameter's dtype (bf16, unit roundoff u), so they differ by at most
u·(Σ_r‖g_r‖ + ‖G‖) in the norm, plus the fp32 reassociation of at most R*T = 256 terms (256 * 2^-24
~ 1.5e-5 of their magnitudes; 1e-4 is allowed). The routing itself is compared exactly.
"""

from __future__ import annotations

import pytest

import module_ranks
from cuda_checks import NEEDS_HOPPER_KERNELS
from distributed import GPU_RANK_ENV, assert_every_rank_returned, spawn_ranks

pytest.importorskip("megatron.core")
pytestmark = NEEDS_HOPPER_KERNELS


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_megatron_module_over_processes_on_one_gpu_equals_the_one_rank_module(num_ranks, tmp_path):
    path = str(tmp_path / "one_rank.pt")
    assert_every_rank_returned(spawn_ranks(module_ranks.one_rank_module, 1, num_ranks, path, timeout_s=240, env=GPU_RANK_ENV))
    outcomes = spawn_ranks(module_ranks.ranks_module, num_ranks, path, timeout_s=240, env=GPU_RANK_ENV, barrier_at_end=True)
    assert_every_rank_returned(outcomes)
    results = [o.result for o in outcomes]
    assert all(r["memory"] == "cuda_ipc" for r in results), results
    print(f"\nMoKMoELayer over {num_ranks} processes on one GPU: bitwise the one-rank module "
          f"{ {name: all(r['bitwise'][name] for r in results) for name in results[0]['bitwise']} }")
