"""Communication across the expert-parallel group: the group itself (`group.py`) and the exchange
stage (`exchange.py`), the only place where data crosses ranks."""

from megatron_mok.comm.exchange import CollectiveExchange, Exchange, exchange_for
from megatron_mok.comm.group import (
    ExpertParallelGroup,
    ProcessGroup,
    clear_expert_parallel_groups,
    get_expert_parallel_group,
)

__all__ = [
    "CollectiveExchange",
    "Exchange",
    "ExpertParallelGroup",
    "ProcessGroup",
    "clear_expert_parallel_groups",
    "exchange_for",
    "get_expert_parallel_group",
]
