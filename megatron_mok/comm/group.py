"""The expert-parallel group as MoK sees it: who we are in it, and its fixed-size collectives.

One `ExpertParallelGroup` per (process group, device), created on first use and cached. The
collectives here are fixed-size (all-gather, equal-split all-to-all), so no receive count ever has
to reach the host. The symmetric buffers and signals of the in-kernel exchange will be kept here
too, allocated once per group (allocation and rendezvous cannot be captured in a CUDA graph).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclasses.dataclass
class ExpertParallelGroup:
    group: Optional[ProcessGroup]  # None: one rank
    rank: int
    num_ranks: int
    device: torch.device

    def symmetric_pool(self):
        """The group's symmetric buffers (comm/symmetric.py), or None: the exchange then runs on
        collectives. A process group gets none yet: torch symmetric memory across processes is
        written (symmetric.torch_symmetric_allocator) but not run on a multi-GPU node; one rank
        needs no exchange at all. megatron_mok.emulation's ranks have one."""
        return None

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns (num_ranks, *tensor.shape): every rank's `tensor`, in rank order."""
        tensor = tensor.contiguous()
        if self.num_ranks == 1:
            return tensor.unsqueeze(0)
        out = torch.empty((self.num_ranks, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        if tensor.device.type == "cpu":
            # gloo has no all_gather_into_tensor; the list form writes into views of `out`.
            dist.all_gather(list(out.unbind(0)), tensor, group=self.group)
        else:
            dist.all_gather_into_tensor(out, tensor, group=self.group)
        return out

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """Equal-split all-to-all: send[r] goes to rank r; returns recv with recv[r] from rank r."""
        send = send.contiguous()
        if send.shape[0] != self.num_ranks:
            raise ValueError(f"all_to_all needs a leading dim of {self.num_ranks}, got {send.shape}")
        if self.num_ranks == 1:
            return send
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv


# Keyed by the group object itself (None for one rank): id() would not trace under torch.compile.
_GROUPS: dict[tuple[Optional[ProcessGroup], str], ExpertParallelGroup] = {}


def get_expert_parallel_group(
    group: Optional[ProcessGroup | ExpertParallelGroup], device: torch.device
) -> ExpertParallelGroup:
    """The ExpertParallelGroup of `group` on `device`, created on first use and cached; an
    ExpertParallelGroup itself (e.g. a rank of megatron_mok.emulation.EmulatedGroup) is returned as is."""
    if isinstance(group, ExpertParallelGroup):
        if group.device != torch.device(device):
            raise ValueError(f"group: this expert-parallel group lives on {group.device}, the tensors on {device}")
        return group
    key = (group, str(device))
    ep_group = _GROUPS.get(key)
    if ep_group is None:
        if group is None or not dist.is_initialized():
            if group is not None:
                raise ValueError("group was given but torch.distributed is not initialized")
            rank, num_ranks = 0, 1
        else:
            rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
            if rank < 0:
                raise ValueError("group: this process is not a member of the given process group")
        ep_group = ExpertParallelGroup(group=group, rank=rank, num_ranks=num_ranks, device=torch.device(device))
        _GROUPS[key] = ep_group
    return ep_group


def clear_expert_parallel_groups() -> None:
    """Drops every cached ExpertParallelGroup (e.g. after destroying process groups)."""
    _GROUPS.clear()
