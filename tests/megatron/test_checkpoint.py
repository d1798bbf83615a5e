"""A torch_dist checkpoint saved with `mok` loads with `alltoall` and back, at EP = 1 and 2."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.distributed


def _sequential_fc(model, layer: int, name: str) -> torch.Tensor:
    experts = model.decoder.layers[layer].mlp.experts.local_experts
    return torch.stack([getattr(e, name).weight.detach() for e in experts])


def _checkpoint_body(rank, world_size, ep, directory):
    import megatron_harness as mh
    from megatron.core import dist_checkpointing, parallel_state

    mh.init_megatron(tp=1, ep=ep, seed=1)
    seq, batch, vocab = 16, 2, 128
    source = mh.gpt_model(mh.transformer_config("alltoall", ep=ep), "alltoall", vocab, seq)
    mok_dir, back_dir = f"{directory}/from_alltoall", f"{directory}/from_mok"
    if rank == 0:
        import os

        os.makedirs(mok_dir)
        os.makedirs(back_dir)
    torch.distributed.barrier()
    dist_checkpointing.save(source.sharded_state_dict(), mok_dir)

    # alltoall -> mok: a model initialized from another seed takes the saved weights.
    torch.manual_seed(99)
    mh.init_megatron(tp=1, ep=ep, seed=2)
    mok = mh.gpt_model(mh.transformer_config("mok", ep=ep), "mok", vocab, seq)
    assert not torch.equal(mok.decoder.layers[0].mlp.experts.weight1.detach(), _sequential_fc(source, 0, "linear_fc1"))
    mok.load_state_dict(dist_checkpointing.load(mok.sharded_state_dict(), mok_dir))
    for layer in range(len(source.decoder.layers)):
        experts = mok.decoder.layers[layer].mlp.experts
        assert torch.equal(experts.weight1.detach(), _sequential_fc(source, layer, "linear_fc1")), f"layer {layer} fc1"
        assert torch.equal(experts.weight2.detach(), _sequential_fc(source, layer, "linear_fc2")), f"layer {layer} fc2"
    for (name, p_src), (name_mok, p_mok) in zip(
        ((n, p) for n, p in source.named_parameters() if "local_experts" not in n),
        ((n, p) for n, p in mok.named_parameters() if ".experts.weight" not in n),
    ):
        assert name == name_mok and torch.equal(p_src, p_mok), name

    # The loaded mok model computes what the alltoall model computes.
    gen = torch.Generator().manual_seed(3 + rank)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    positions = torch.arange(seq).expand(batch, seq)
    mask = mh.causal_mask(batch, seq)
    with torch.no_grad():
        want = source(tokens, positions, mask)
        got = mok(tokens, positions, mask)
    # Same weights and routing in fp32, two summation orders: scheme 3 with paths=2 (tests/oracle.py),
    # as in test_megatron_equivalence.py.
    from oracle import assert_norm_relative, oracle_bound

    assert_norm_relative(got, want, oracle_bound(torch.float32, paths=2), msg="loaded mok model output")

    # mok -> alltoall: save the mok model, load it into a fresh alltoall model.
    dist_checkpointing.save(mok.sharded_state_dict(), back_dir)
    mh.init_megatron(tp=1, ep=ep, seed=3)
    back = mh.gpt_model(mh.transformer_config("alltoall", ep=ep), "alltoall", vocab, seq)
    back.load_state_dict(dist_checkpointing.load(back.sharded_state_dict(), back_dir))
    for (name, p_src), (_, p_back) in zip(source.named_parameters(), back.named_parameters()):
        assert torch.equal(p_src, p_back), f"round trip changed {name}"
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ep,world_size", [(1, 1), (2, 2)], ids=["ep1", "ep2"])
def test_checkpoint_round_trip_mok_alltoall(ep, world_size, tmp_path):
    run_distributed(_checkpoint_body, world_size, ep, str(tmp_path))
