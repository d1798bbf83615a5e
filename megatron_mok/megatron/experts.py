"""Grouped expert weights: one (E_local, 2F, H) and one (E_local, H, F) tensor per layer.

`GroupedExpertWeights` is what every module here that keeps its local experts in two grouped tensors
shares: MoK's experts (the fused kernel reads every local expert from one tensor) and
`GroupedMMExperts` (grouped_mm_experts.py). The weights still behave like Megatron's expert weights:
- `allreduce=False` where Megatron's own experts set it, so DDP and the distributed optimizer
  reduce their gradients over the expert-data-parallel group;
- the sharded state dict uses SequentialMLP's keys and offsets (per global expert, fc1 split into
  its gate and up halves as Megatron's SwiGLU factory does), so a `torch_dist` checkpoint saved
  with `mok` loads into `alltoall`/`allgather` layers (SequentialMLP or TEGroupedMLP) and back.

Notation: E_local local experts, H hidden, F expert FFN (moe_ffn_hidden_size).
"""

from __future__ import annotations

import abc
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_object_for_checkpoint,
)

# State-dict keys of the per-expert `_extra_state` entries that SequentialMLP's linears carry
# (None for Megatron's local linears). Grouped weights have no such state; they write and accept
# them only so that checkpoints interchange with SequentialMLP/TEGroupedMLP.
_EXTRA_STATE = "sequential_extra_state"


def _param_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@torch.no_grad()
def _initialize(fc1: torch.Tensor, fc2: torch.Tensor, config: TransformerConfig) -> None:
    """Per expert, fc1 then fc2, with Megatron's init methods: the order in which SequentialMLP
    builds (and so draws the weights of) its experts' linears."""
    tracker = get_cuda_rng_tracker()
    rng_name = get_expert_parallel_rng_tracker_name()
    # Same RNG stream as Megatron's expert linears when the tracker has it (GPU training).
    use_tracker = fc1.is_cuda and rng_name in tracker.get_states()
    for local_expert in range(fc1.shape[0]):
        for weight, init_method in ((fc1, config.init_method), (fc2, config.output_layer_init_method)):
            if use_tracker:
                with tracker.fork(rng_name):
                    init_method(weight[local_expert])
            else:
                init_method(weight[local_expert])


class GroupedExpertWeights(MegatronModule, abc.ABC):
    """Local experts kept in two grouped tensors (SwiGLU, no bias, expert-TP 1), checkpointed in
    SequentialMLP's sharded layout. Subclasses check the config they run (`_check`), register the
    two tensors where their layout keeps them (`_hold`) and name them in `_grouped_weights`."""

    # Megatron's experts-builder signature, so that a MoE spec can name a subclass itself.
    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        /,
        *,
        pg_collection: Optional[ProcessGroupCollection] = None,
        name: Optional[str] = None,
    ) -> None:
        self._check(config)
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.expt_dp_group = pg_collection.expt_dp
        self._hold(*self._new_weights(config))

    def _check(self, config: TransformerConfig) -> None:
        """Raises ValueError naming the flags of a config the subclass does not run."""

    @abc.abstractmethod
    def _hold(self, fc1: torch.nn.Parameter, fc2: torch.nn.Parameter) -> None:
        """Registers fc1 (E_local, 2F, H) and fc2 (E_local, H, F) where the layout keeps them."""

    @abc.abstractmethod
    def _grouped_weights(self) -> tuple[tuple[str, torch.Tensor, str, bool], ...]:
        """Per grouped tensor, fc1 first: (its name in this module's state dict, the tensor,
        SequentialMLP's key for it, whether it splits into gate and up halves)."""

    def _new_weights(self, config: TransformerConfig) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        """fc1 (E_local, 2F, H), per expert gate rows then up rows as Megatron's fc1, and fc2
        (E_local, H, F), as Megatron's fc2; marked and initialized like Megatron's expert weights."""
        hidden = config.hidden_size
        ffn_hidden = config.moe_ffn_hidden_size
        device = _param_device(config)
        shapes = ((self.num_local_experts, 2 * ffn_hidden, hidden), (self.num_local_experts, hidden, ffn_hidden))
        fc1, fc2 = (
            torch.nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device)) for shape in shapes
        )
        # Megatron's expert linears mark weights for expert-DP reduction exactly so.
        reduce_over_expert_dp = config.expert_model_parallel_size > 1 or (
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        for weight, partition_dim in ((fc1, 1), (fc2, 2)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=1)
            weight.allreduce = not reduce_over_expert_dp
        if config.perform_initialization:
            _initialize(fc1, fc2, config)
        return fc1, fc2

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward itself (no delayed wgrad)."""

    def _expert_shards(
        self,
        key: str,
        tensor: torch.Tensor,
        sharded_offsets: tuple,
        replica_id: tuple,
        split_gate_up: bool,
        singleton_local_shards: bool,
    ) -> list[ShardedTensor]:
        """SequentialMLP's shards of one grouped weight: one (or, for fc1, two) per expert."""
        num_global_experts = self.ep_group.size() * self.num_local_experts
        first_global_expert = self.ep_group.rank() * self.num_local_experts
        prepend = len(sharded_offsets)
        shards = []
        for local_expert in range(self.num_local_experts):
            global_expert = first_global_expert + local_expert
            expert_weight = tensor[local_expert]
            if singleton_local_shards:
                expert_key = key.replace("{expert}", f"{global_expert}.")
                expert_offsets = sharded_offsets
            else:
                expert_key = key.replace("{expert}", "")
                expert_offsets = (*sharded_offsets, (prepend, global_expert, num_global_experts))
            axis = len(expert_offsets)
            if split_gate_up:
                gate, up = torch.chunk(expert_weight, 2, dim=0)
                if singleton_local_shards:
                    parts = ((f"{expert_key}_w", gate, (axis, 0, 1)), (f"{expert_key}_v", up, (axis, 0, 1)))
                else:
                    parts = ((expert_key, gate, (axis, 0, 2)), (expert_key, up, (axis, 1, 2)))
            else:
                parts = ((expert_key, expert_weight, (axis + 1, 0, 1)),)
            for part_key, part, part_offset in parts:
                shards.append(
                    ShardedTensor.from_rank_offsets(
                        part_key,
                        part,
                        *expert_offsets,
                        part_offset,
                        replica_id=replica_id,
                        prepend_axis_num=len(expert_offsets),
                    )
                )
        return shards

    def _extra_state_objects(self, prefix: str, sharded_offsets: tuple, replica_id: tuple, singleton: bool) -> dict:
        num_global_experts = self.ep_group.size() * self.num_local_experts
        first_global_expert = self.ep_group.rank() * self.num_local_experts
        objects = {}
        for local_expert in range(self.num_local_experts):
            global_expert = first_global_expert + local_expert
            for linear in ("linear_fc1", "linear_fc2"):
                if singleton:
                    key, offsets = f"{prefix}experts.{global_expert}.{linear}._extra_state", sharded_offsets
                else:
                    key = f"{prefix}experts.{linear}._extra_state"
                    offsets = (*sharded_offsets, (len(sharded_offsets), global_expert, num_global_experts))
                objects[f"{prefix}{_EXTRA_STATE}.{local_expert}.{linear}"] = make_sharded_object_for_checkpoint(
                    None, key, offsets, replica_id
                )
        return objects

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The SequentialMLP-compatible extra states hold nothing grouped weights use.
        for key in [k for k in state_dict if k.startswith(f"{prefix}{_EXTRA_STATE}.")]:
            del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        """SequentialMLP-compatible shards: `{prefix}experts.linear_fc{1,2}.weight` per global expert."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        # Replicated along expert-data-parallel only (expert-TP is 1): (PP, TP, DP) format.
        replica_id = (0, 0, self.expt_dp_group.rank())
        state = {}
        for param_name, tensor, key_name, split_gate_up in self._grouped_weights():

            def build(factory_key, tensor, factory_replica_id, flattened_range, _param=param_name, _key=key_name, _split=split_gate_up):
                del flattened_range
                # Containers rewrite the factory's key (TransformerBlock drops the layer number),
                # so the shard keys derive from the key the factory is built with.
                module_prefix = factory_key[: -len(_param)]
                return self._expert_shards(
                    f"{module_prefix}experts.{{expert}}{_key}", tensor, sharded_offsets, factory_replica_id,
                    _split, singleton_local_shards,
                )

            def merge(shards: list[torch.Tensor], _split=split_gate_up) -> torch.Tensor:
                step = 2 if _split else 1
                experts = [torch.cat(shards[i : i + step], dim=0) for i in range(0, len(shards), step)]
                return torch.stack(experts, dim=0)

            state[f"{prefix}{param_name}"] = ShardedTensorFactory(
                f"{prefix}{param_name}", tensor, build, merge, replica_id
            )
        state.update(self._extra_state_objects(prefix, sharded_offsets, replica_id, singleton_local_shards))
        return state


class MoKGroupedExperts(GroupedExpertWeights):
    """The routed experts of one MoK layer: `weight1` (E_local, 2F, H) and `weight2` (E_local, H, F),
    which the MoK layer passes to `mok_moe` (the MoK layer checks the config: checks.py)."""

    def _hold(self, fc1: torch.nn.Parameter, fc2: torch.nn.Parameter) -> None:
        self.weight1, self.weight2 = fc1, fc2

    def _grouped_weights(self) -> tuple[tuple[str, torch.Tensor, str, bool], ...]:
        return (("weight1", self.weight1, "linear_fc1.weight", True), ("weight2", self.weight2, "linear_fc2.weight", False))

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "MoKGroupedExperts holds weights only; the MoK layer runs them through mok_moe"
        )


def expert_parallel_group(pg_collection: ProcessGroupCollection):
    """The group MoK dispatches over: Megatron's tp_ep group (expert-TP is 1, so it is EP)."""
    return pg_collection.tp_ep if pg_collection.tp_ep is not None else parallel_state.get_expert_tensor_and_model_parallel_group()
