"""`mok` vs Megatron's `alltoall` from the same weights and routing: MoE layers (with TP/SP and
EP) and whole GPT models (EP = 1, 2, 4), outputs and gradients; `alltoall_grouped` (alltoall with
GroupedMMExperts) likewise for layers at EP = 1 and 2.

Tolerance: everything runs in fp32 on the same routing; the two paths differ only in summation
order (alltoall's unpermute adds the k results in its own order, MoK in ascending k; GEMMs see
different row groupings): two fp32 evaluations of one formula, tests/oracle.py's scheme 3 with
paths=2, while a single misrouted token changes a tensor by O(1) relative.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.distributed


def _assert_close(got, want, msg: str) -> None:
    from oracle import assert_norm_relative, oracle_bound

    assert_norm_relative(got, want, oracle_bound(torch.float32, paths=2), msg=msg)


def _expert_grads(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_local, 2F, H) and (E_local, H, F) weight gradients of either kind of expert module."""
    experts = layer.experts
    if hasattr(experts, "weight1"):
        return experts.weight1.grad, experts.weight2.grad
    if hasattr(experts, "linear_fc1"):
        return experts.linear_fc1.weight.grad, experts.linear_fc2.weight.grad
    fc1 = torch.stack([e.linear_fc1.weight.grad for e in experts.local_experts])
    fc2 = torch.stack([e.linear_fc2.weight.grad for e in experts.local_experts])
    return fc1, fc2


def _layer_body(rank, world_size, tp, ep, dispatcher):
    import megatron_harness as mh
    from megatron.core import parallel_state

    mh.init_megatron(tp=tp, ep=ep)
    ref = mh.moe_layer(mh.transformer_config("alltoall", tp=tp, ep=ep, num_layers=1), "alltoall")
    mok = mh.moe_layer(mh.transformer_config(dispatcher, tp=tp, ep=ep, num_layers=1), dispatcher)
    mok.load_state_dict(mh.grouped_expert_state(ref.state_dict(), ref.num_local_experts, dispatcher))
    # Different tokens on every rank (sequence-parallel shards and data-parallel replicas).
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 2, 32, generator=gen)
    grad = torch.randn(8, 2, 32, generator=gen)
    results = []
    for layer in (ref, mok):
        xi = x.clone().requires_grad_()
        y, bias = layer(xi)
        assert bias is None
        y.backward(grad)
        results.append((y.detach(), xi.grad, layer.router.weight.grad, *_expert_grads(layer)))
    names = ("output", "input grad", "router grad", "fc1 grad", "fc2 grad")
    for name, want, got in zip(names, results[0], results[1]):
        _assert_close(got, want, f"rank {rank} tp={tp} ep={ep} {dispatcher}: {name}")
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize(
    "tp,ep,world_size,dispatcher",
    [(1, 1, 1, "mok"), (1, 2, 2, "mok"), (2, 1, 2, "mok"), (1, 4, 4, "mok"), (2, 2, 4, "mok"),
     (1, 1, 1, "alltoall_grouped"), (1, 2, 2, "alltoall_grouped")],
    ids=["ep1", "ep2", "tp2_sp", "ep4", "ep2_tp2_sp", "grouped_ep1", "grouped_ep2"],
)
def test_moe_layer_matches_alltoall(tp, ep, world_size, dispatcher):
    run_distributed(_layer_body, world_size, tp, ep, dispatcher)


def _gpt_body(rank, world_size, ep):
    import megatron_harness as mh
    from megatron.core import parallel_state

    mh.init_megatron(tp=1, ep=ep)
    seq, batch, vocab = 16, 2, 128
    ref = mh.gpt_model(mh.transformer_config("alltoall", ep=ep), "alltoall", vocab, seq)
    mok = mh.gpt_model(mh.transformer_config("mok", ep=ep), "mok", vocab, seq)
    num_local = ref.decoder.layers[0].mlp.num_local_experts
    mok.load_state_dict(mh.grouped_expert_state(ref.state_dict(), num_local))

    gen = torch.Generator().manual_seed(7 + rank)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    positions = torch.arange(seq).expand(batch, seq)
    mask = mh.causal_mask(batch, seq)
    losses, grads = [], []
    for model in (ref, mok):
        loss = model(tokens, positions, mask, labels=labels)
        loss.sum().backward()
        losses.append(loss.detach())
        named = {
            "embedding": model.embedding.word_embeddings.weight.grad,
            "output layer": model.output_layer.weight.grad,
        }
        for i, layer in enumerate(model.decoder.layers):
            named[f"layer {i} router"] = layer.mlp.router.weight.grad
            named[f"layer {i} qkv"] = layer.self_attention.linear_qkv.weight.grad
            named[f"layer {i} fc1"], named[f"layer {i} fc2"] = _expert_grads(layer.mlp)
        grads.append(named)
    _assert_close(losses[1], losses[0], f"rank {rank} ep={ep}: loss")
    for name, want in grads[0].items():
        _assert_close(grads[1][name], want, f"rank {rank} ep={ep}: {name} grad")
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ep,world_size", [(1, 1), (2, 2), (4, 4)], ids=["ep1", "ep2", "ep4"])
def test_gpt_model_matches_alltoall(ep, world_size):
    run_distributed(_gpt_body, world_size, ep)
