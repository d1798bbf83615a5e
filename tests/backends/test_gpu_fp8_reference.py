"""The reference backend's FP8 blockwise layer on a CUDA device: the recipe as on CPU (against the
independent emulation, tests/fp8_emulation.py; bars derived in tests/api/test_fp8_layer.py), no host
synchronization, bitwise reproducible, a CUDA graph's replay equal to eager (the weights quantized
inside the graph), and emulated ranks bitwise equal to EP = 1 (an emulated group that offers the
symmetric exchange runs FP8 over the collective one). Skipped without a GPU."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import pytest
import torch

from megatron_mok import MoKConfig, mok_moe
from megatron_mok.emulation import EmulatedGroup
from cuda_checks import assert_bitwise_reproducible_without_host_sync, assert_mok_moe_graph_replays_eager
from fp8_emulation import fp8_layer
from oracle import sqnr_db

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
from test_emulation import ROUTINGS, assert_bitwise, make_problem, run_concatenated, run_emulated  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FP8 = MoKConfig(backend="reference", precision="fp8_blockwise")
# bf16 activations against the emulation (tests/api/test_fp8_layer.py derives it).
EMULATION_BAR_DB = 50.0


def _inputs(t=300, h=512, f=256, e=8, k=4, seed=0, drop=0.2):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(t)])
    ids = torch.where(torch.rand(t, k, device="cuda", generator=gen) < drop, -1, ids)
    w = torch.rand(t, k, device="cuda", generator=gen)
    fc1 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) / h**0.5).to(torch.bfloat16)
    fc2 = (torch.randn(e, h, f, device="cuda", generator=gen) / f**0.5).to(torch.bfloat16)
    grad = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    return x, ids, w, fc1, fc2, grad


def _fwd_bwd(x, ids, w, fc1, fc2, grad, config=FP8):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, fc1, fc2)]
    y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], config=config)
    y.backward(grad)
    return y.detach(), [leaf.grad for leaf in leaves]


def test_cuda_fp8_reference_matches_the_emulation():
    inputs = _inputs()
    y, grads = _fwd_bwd(*inputs)
    want = fp8_layer(*(t.cpu() for t in inputs))
    for name, got, w in zip(("y", "dx", "dtopk_weights", "dfc1", "dfc2"), (y, *grads), (want.y, want.x, want.topk_weights, want.fc1, want.fc2)):
        db = sqnr_db(got.cpu(), w)
        assert db >= EMULATION_BAR_DB, f"{name}: {db:.1f} dB against the emulation"


def test_cuda_fp8_reference_has_no_host_sync_and_is_bitwise_deterministic():
    inputs = _inputs(seed=1)
    assert_bitwise_reproducible_without_host_sync(lambda: _fwd_bwd(*inputs))


def test_cuda_fp8_graph_capture_and_replay():
    assert_mok_moe_graph_replays_eager(FP8, *_inputs(seed=2))


@pytest.mark.parametrize("routing", ROUTINGS)
def test_emulated_fp8_equals_ep1_bitwise_on_cuda(routing):
    num_ranks, t, h, f, e, k = 4, 100, 256, 128, 2, 4
    problem = make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16, zlib.crc32(f"fp8/{routing}".encode()))
    # Over the collective exchange: the reference's torch reductions pick their cuBLAS kernels by the
    # number of rows, so over the symmetric exchange (a rank's T rows) it is held to the collective
    # one instead (tests/backends/test_gpu_fp8_kernel.py).
    got = run_emulated(EmulatedGroup(num_ranks, "cuda", exchange="collective"), problem, e, FP8)
    torch.cuda.synchronize()
    assert_bitwise(got, run_concatenated(problem, FP8), f"fp8 cuda {routing}")
