"""The reference backend on a CUDA device: same contract, no host synchronization, graph capture.

Skipped without a GPU; run on the device machine.
"""

from __future__ import annotations

import pytest
import torch

from megatron_mok import MoKConfig, mok_moe
from cuda_checks import assert_bitwise_reproducible_without_host_sync, assert_mok_moe_graph_replays_eager
from oracle import assert_norm_relative, moe_float64_with_grads, oracle_bound

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _inputs(t=64, h=128, f=64, e=8, k=4, dtype=torch.bfloat16, seed=0, drop=0.2):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(t)])
    ids = torch.where(torch.rand(t, k, device="cuda", generator=gen) < drop, -1, ids)
    w = torch.rand(t, k, device="cuda", generator=gen)
    fc1 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) / h**0.5).to(dtype)
    fc2 = (torch.randn(e, h, f, device="cuda", generator=gen) / f**0.5).to(dtype)
    grad = torch.randn(t, h, device="cuda", generator=gen).to(dtype)
    return x, ids, w, fc1, fc2, grad


def _fwd_bwd(x, ids, w, fc1, fc2, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, fc1, fc2)]
    y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], config=MoKConfig(backend="reference"))
    y.backward(grad)
    return y.detach(), [leaf.grad for leaf in leaves]


def test_cuda_reference_matches_oracle():
    x, ids, w, fc1, fc2, grad = _inputs()
    y, grads = _fwd_bwd(x, ids, w, fc1, fc2, grad)
    y_ref, ref_grads = moe_float64_with_grads(x, ids, w, fc1, fc2, grad)
    bound = oracle_bound(torch.bfloat16)  # scheme 3 (tests/oracle.py)
    assert_norm_relative(y.cpu(), y_ref, bound, msg="y")
    for name, got, want in zip(("x", "topk_weights", "fc1", "fc2"), grads, ref_grads):
        assert_norm_relative(got.cpu(), want, bound, msg=f"d{name}")


def test_cuda_reference_has_no_host_sync_and_is_bitwise_deterministic():
    inputs = _inputs(seed=1)
    assert_bitwise_reproducible_without_host_sync(lambda: _fwd_bwd(*inputs))


def test_cuda_graph_capture_and_replay():
    assert_mok_moe_graph_replays_eager(MoKConfig(backend="reference"), *_inputs(seed=2))
