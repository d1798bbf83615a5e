"""The Megatron-LM plugin: the `mok` dispatcher type, its MoE layer, expert weights and specs."""

from megatron_mok.megatron.register import add_mok_arguments, is_registered, register

__all__ = ["add_mok_arguments", "is_registered", "register"]
