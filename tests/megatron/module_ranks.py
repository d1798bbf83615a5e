"""The bodies of tests/megatron/test_gpu_process_group_module.py, one process per rank (kept apart from
the test module: a spawned rank imports this, which must not start CUDA before the rank's environment
is set). The test module's docstring says what is compared and why the bounds hold."""

from __future__ import annotations

import torch

# Per rank: T tokens, H hidden, F expert FFN, E local experts, K top-k.
NUM_TOKENS, HIDDEN, FFN, LOCAL_EXPERTS, TOPK = 32, 256, 128, 2, 4
# The router's weight gradient, R partial fp32 sums added against one sum over R*T tokens: fp32
# reassociation of at most R*T = 256 terms, 256 * 2^-24 ~ 1.5e-5 of their magnitudes (the test
# module's docstring), on top of the roundings to the parameter's dtype (router_grad_bound).
ROUTER_GRAD_REASSOCIATION = 1e-4


def _module(ep: int, num_experts: int):
    import megatron_harness as mh
    from megatron_mok import MoKConfig

    config = mh.transformer_config(
        "mok", ep=ep, num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN, num_attention_heads=4,
        num_moe_experts=num_experts, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
        params_dtype=torch.bfloat16, bf16=True,
    )
    config.mok_config = MoKConfig(backend="kernel", exchange="symmetric" if ep > 1 else "auto")
    return mh.moe_layer(config, "mok").cuda()


def _step(layer, x: torch.Tensor, grad: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    y, bias = layer(x)
    assert bias is None
    y.backward(grad)
    return dict(
        y=y.detach(), dx=x.grad, ids=layer.token_dispatcher.topk_ids.clone(), router_grad=layer.router.weight.grad.float(),
        dfc1=layer.experts.weight1.grad, dfc2=layer.experts.weight2.grad,
    )


def one_rank_module(rank, world_size, num_ranks, path):
    import megatron_harness as mh

    torch.cuda.set_device(0)
    mh.init_megatron(ep=1)
    layer = _module(1, num_ranks * LOCAL_EXPERTS)
    gen = torch.Generator(device="cuda").manual_seed(7)
    # (R*T, 1, H): the ranks' tokens in rank order, sequence-major as Megatron passes them.
    x = torch.randn(num_ranks * NUM_TOKENS, 1, HIDDEN, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(num_ranks * NUM_TOKENS, 1, HIDDEN, device="cuda", generator=gen).bfloat16()
    results = _step(layer, x, grad)
    state = dict(router=layer.router.weight.detach(), weight1=layer.experts.weight1.detach(), weight2=layer.experts.weight2.detach())
    saved = {"x": x, "grad": grad, **state, **results}
    assert len(saved) == 2 + len(state) + len(results), "a result's name is a weight's: it would overwrite it"
    torch.save({k: v.cpu() for k, v in saved.items()}, path)


def ranks_module(rank, world_size, path):
    import megatron_harness as mh
    import torch.distributed as dist
    from megatron.core import parallel_state

    from oracle import assert_norm_relative, roundings_bound, unit_roundoff

    torch.cuda.set_device(0)
    mh.init_megatron(ep=world_size)
    ref = {k: v.cuda() for k, v in torch.load(path).items()}
    layer = _module(world_size, world_size * LOCAL_EXPERTS)
    own = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    mine = slice(rank * NUM_TOKENS, (rank + 1) * NUM_TOKENS)
    with torch.no_grad():
        layer.router.weight.copy_(ref["router"])
        layer.experts.weight1.copy_(ref["weight1"][own])
        layer.experts.weight2.copy_(ref["weight2"][own])
    got = _step(layer, ref["x"][mine], ref["grad"][mine])
    torch.cuda.synchronize()

    assert torch.equal(got["ids"], ref["ids"][mine]), f"rank {rank}: the routing differs from the one-rank module's"
    want = dict(y=ref["y"][mine], dx=ref["dx"][mine], dfc1=ref["dfc1"][own], dfc2=ref["dfc2"][own])
    bitwise = {name: bool(torch.equal(got[name], value)) for name, value in want.items()}
    for name, value in want.items():  # one bf16 rounding apart (scheme 3)
        assert_norm_relative(
            got[name], value, roundings_bound(torch.bfloat16, 1), msg=f"rank {rank}: {name} against the one-rank module"
        )
    # Replicated router weights: their gradient is the sum of the ranks' (Megatron's data-parallel
    # reduction). Each rank's gradient g_r and the one-rank module's G are rounded once to the
    # parameter's dtype (u its unit roundoff), so ‖Σ fl(g_r) − fl(G)‖ ≤ u·(Σ‖g_r‖ + ‖G‖) plus the
    # reassociation of the fp32 sums.
    router_grad = got["router_grad"].cpu()
    norms = router_grad.norm().reshape(1)
    dist.all_reduce(router_grad, group=parallel_state.get_data_parallel_group())
    dist.all_reduce(norms, group=parallel_state.get_data_parallel_group())
    want_grad = ref["router_grad"].cpu()
    u = unit_roundoff(layer.router.weight.dtype)
    bound = u * (float(norms) + float(want_grad.norm())) / float(want_grad.norm()) + ROUTER_GRAD_REASSOCIATION
    assert_norm_relative(router_grad, want_grad, bound, msg=f"rank {rank}: router weight gradient")
    ep_group = layer.mok_group
    from megatron_mok.comm import get_expert_parallel_group

    memory = get_expert_parallel_group(ep_group, torch.device("cuda", 0)).symmetric_memory().kind
    parallel_state.destroy_model_parallel()
    return dict(bitwise=bitwise, memory=memory)
