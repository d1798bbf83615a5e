"""A torch_dist checkpoint saved with `alltoall` (SequentialMLP) loads with `mok` and with
`alltoall_grouped` (GroupedMMExperts), and theirs load back, at EP = 1 and 2."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.distributed


def _sequential_fc(model, layer: int, name: str) -> torch.Tensor:
    experts = model.decoder.layers[layer].mlp.experts.local_experts
    return torch.stack([getattr(e, name).weight.detach() for e in experts])


def _grouped_fc(model, layer: int, name: str, dispatcher: str) -> torch.Tensor:
    import megatron_harness as mh

    experts = model.decoder.layers[layer].mlp.experts
    return experts.get_parameter(mh.GROUPED_WEIGHT_NAMES[dispatcher][name]).detach()


def _checkpoint_body(rank, world_size, ep, directory, grouped):
    import megatron_harness as mh
    from megatron.core import dist_checkpointing, parallel_state

    mh.init_megatron(tp=1, ep=ep, seed=1)
    seq, batch, vocab = 16, 2, 128
    source = mh.gpt_model(mh.transformer_config("alltoall", ep=ep), "alltoall", vocab, seq)
    alltoall_dir, back_dir = f"{directory}/from_alltoall", f"{directory}/from_grouped"
    if rank == 0:
        import os

        os.makedirs(alltoall_dir)
        os.makedirs(back_dir)
    torch.distributed.barrier()
    dist_checkpointing.save(source.sharded_state_dict(), alltoall_dir)

    # alltoall -> grouped: a model initialized from another seed takes the saved weights.
    torch.manual_seed(99)
    mh.init_megatron(tp=1, ep=ep, seed=2)
    loaded = mh.gpt_model(mh.transformer_config(grouped, ep=ep), grouped, vocab, seq)
    assert not torch.equal(_grouped_fc(loaded, 0, "linear_fc1", grouped), _sequential_fc(source, 0, "linear_fc1"))
    loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), alltoall_dir))
    for layer in range(len(source.decoder.layers)):
        for fc in ("linear_fc1", "linear_fc2"):
            assert torch.equal(_grouped_fc(loaded, layer, fc, grouped), _sequential_fc(source, layer, fc)), f"layer {layer} {fc}"
    for (name, p_src), (name_loaded, p_loaded) in zip(
        ((n, p) for n, p in source.named_parameters() if "local_experts" not in n),
        ((n, p) for n, p in loaded.named_parameters() if ".experts." not in n),
    ):
        assert name == name_loaded and torch.equal(p_src, p_loaded), name

    # The loaded model computes what the alltoall model computes.
    gen = torch.Generator().manual_seed(3 + rank)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    positions = torch.arange(seq).expand(batch, seq)
    mask = mh.causal_mask(batch, seq)
    with torch.no_grad():
        want = source(tokens, positions, mask)
        got = loaded(tokens, positions, mask)
    # Same weights and routing in fp32, two summation orders: scheme 3 with paths=2 (tests/oracle.py),
    # as in test_megatron_equivalence.py.
    from oracle import assert_norm_relative, oracle_bound

    assert_norm_relative(got, want, oracle_bound(torch.float32, paths=2), msg=f"loaded {grouped} model output")

    # grouped -> alltoall: save the grouped model, load it into a fresh alltoall model.
    dist_checkpointing.save(loaded.sharded_state_dict(), back_dir)
    mh.init_megatron(tp=1, ep=ep, seed=3)
    back = mh.gpt_model(mh.transformer_config("alltoall", ep=ep), "alltoall", vocab, seq)
    back.load_state_dict(dist_checkpointing.load(back.sharded_state_dict(), back_dir))
    for (name, p_src), (_, p_back) in zip(source.named_parameters(), back.named_parameters()):
        assert torch.equal(p_src, p_back), f"round trip changed {name}"
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("grouped", ["mok", "alltoall_grouped"])
@pytest.mark.parametrize("ep,world_size", [(1, 1), (2, 2)], ids=["ep1", "ep2"])
def test_checkpoint_round_trip_with_alltoall(ep, world_size, grouped, tmp_path):
    run_distributed(_checkpoint_body, world_size, ep, str(tmp_path), grouped)
