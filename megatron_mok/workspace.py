"""The cached per-(group, device) workspace: who we are in the expert-parallel group, and
the collectives the reference backend uses to emulate MoK's symmetric-memory traffic.

The reference moves data with fixed-size collectives only (all-gather of routing and rows,
an equal-split all-to-all for the combine), so no receive count ever has to reach the host.
The multi-GPU kernel will keep its symmetric buffers here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclasses.dataclass
class Workspace:
    group: Optional[ProcessGroup]
    rank: int
    num_ranks: int
    device: torch.device

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
_WORKSPACES: dict[tuple[Optional[ProcessGroup], str], Workspace] = {}


def get_workspace(group: Optional[ProcessGroup], device: torch.device) -> Workspace:
    """The workspace of `group` on `device`, created on first use and cached."""
    key = (group, str(device))
    workspace = _WORKSPACES.get(key)
    if workspace is None:
        if group is None or not dist.is_initialized():
            if group is not None:
                raise ValueError("group was given but torch.distributed is not initialized")
            rank, num_ranks = 0, 1
        else:
            rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
            if rank < 0:
                raise ValueError("group: this process is not a member of the given process group")
        workspace = Workspace(group=group, rank=rank, num_ranks=num_ranks, device=torch.device(device))
        _WORKSPACES[key] = workspace
    return workspace


def clear_workspaces() -> None:
    """Drops every cached workspace (e.g. after destroying process groups)."""
    _WORKSPACES.clear()
