"""megatron_mok: the Mixture-of-Kittens MoE megakernel for Hopper, as a Megatron-LM plugin."""

from megatron_mok.config import MoKConfig
from megatron_mok.functional import ForwardContext, Grads, backward, build_schedule, forward, recompute_forward_context
from megatron_mok.moe import mok_moe
from megatron_mok.schedule import Schedule
from megatron_mok.comm import ExpertParallelGroup, get_expert_parallel_group

__all__ = [
    "ExpertParallelGroup",
    "ForwardContext",
    "Grads",
    "MoKConfig",
    "Schedule",
    "backward",
    "build_schedule",
    "forward",
    "get_expert_parallel_group",
    "mok_moe",
    "recompute_forward_context",
    "register",
]


def register() -> None:
    """Makes Megatron accept `--moe-token-dispatcher-type mok` (see megatron_mok.megatron)."""
    from megatron_mok.megatron.register import register as _register

    _register()
