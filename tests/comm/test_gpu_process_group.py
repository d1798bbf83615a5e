"""The multi-process in-kernel exchange (torch symmetric memory, one process per GPU) on what one
GPU allows: a one-rank NCCL process group. Its regions come from torch symmetric memory
(comm/symmetric.py torch_symmetric_allocator: real symmetric allocations, rendezvous, the peer
table), and every exchange op runs, the signal waits included (the one rank signals itself). Its
outputs and gradients must be bitwise the one-rank layer without an exchange, in one window and
over several (receive_capacity_factor). A group of several GPUs is the multi-GPU issue's run."""

from __future__ import annotations

import pytest
import torch

from cuda_checks import NEEDS_HOPPER_KERNELS

pytestmark = NEEDS_HOPPER_KERNELS


def _one_rank_body(rank, world_size, factor):
    import torch.distributed as dist

    from megatron_mok import MoKConfig, mok_moe
    from megatron_mok.comm import exchange_for, get_expert_parallel_group
    from megatron_mok.comm.symmetric_exchange import SymmetricExchange

    gen = torch.Generator(device="cuda").manual_seed(3)
    t, h, f, e, k = 300, 256, 128, 4, 4
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=-1).indices
    ids[:50] = 0  # one expert takes more than its share
    w = torch.rand(t, k, device="cuda", generator=gen)
    fc1 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    fc2 = (torch.randn(e, h, f, device="cuda", generator=gen) / f**0.5).bfloat16()
    dy = torch.randn(t, h, device="cuda", generator=gen).bfloat16()

    def run(group, config):
        leaves = [a.clone().requires_grad_() for a in (x, w, fc1, fc2)]
        y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], group=group, config=config)
        y.backward(dy)
        return [y.detach(), *(leaf.grad for leaf in leaves)]

    symmetric = MoKConfig(backend="kernel", exchange="symmetric", receive_capacity_factor=factor)
    group = dist.group.WORLD
    assert isinstance(exchange_for(get_expert_parallel_group(group, x.device), "symmetric"), SymmetricExchange)
    want = run(None, MoKConfig(backend="kernel"))
    for attempt in range(2):  # the second call reuses the regions and continues the signal counts
        got = run(group, symmetric)
        for name, a, b in zip(("y", "dx", "dw", "dfc1", "dfc2"), got, want):
            assert torch.equal(a, b), f"{name} differs (call {attempt}, factor {factor})"


@pytest.mark.parametrize("factor", [1.0, 0.25])
def test_one_rank_process_group_runs_the_symmetric_exchange_bitwise(factor):
    from distributed import run_distributed
    from megatron_mok.receive import receive_plan

    # (the body's shape: T 300, K 4, 4 experts; 0.25 gives several windows, 1.0 one)
    plan = receive_plan(num_ranks=1, num_tokens=300, topk=4, num_local_experts=4, segment_alignment=1, factor=factor, windowed=True)
    assert (plan.num_windows > 1) == (factor < 1), plan

    run_distributed(_one_rank_body, 1, factor, backend="nccl")
