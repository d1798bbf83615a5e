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

    _pool: object = dataclasses.field(default=None, repr=False, compare=False)
    # MoKConfig.exchange="auto" takes the symmetric exchange only where this is set (emulated ranks):
    # over a process group it is not yet the default, since it has not run on a multi-GPU node.
    symmetric_by_default: bool = dataclasses.field(default=False, repr=False, compare=False)
    # The call shapes every rank of the group has agreed on (agree_on_call_shape).
    _agreed_shapes: set = dataclasses.field(default_factory=set, repr=False, compare=False)

    def agree_on_call_shape(self, shape: tuple) -> None:
        """A ValueError on every rank when the ranks call with different shapes (num_tokens, hidden,
        topk, ...): their collectives and regions would not match. Checked on each rank's first call
        of a shape, by one host all-gather of the shapes (like the symmetric regions' allocation, it
        cannot be captured in a CUDA graph); later calls of an agreed shape skip it, so the hot path
        never synchronizes with the host. (A rank that passes a new shape while the others pass an
        agreed one is not caught: the ranks of a Megatron job call every layer in the same order.)"""
        if self.num_ranks == 1:
            return
        self._agree(shape)

    @torch.compiler.disable  # a host collective at a shape's first call, outside any traced graph
    def _agree(self, shape: tuple) -> None:
        if shape in self._agreed_shapes:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "megatron_mok: the ranks agree on a layer shape at its first call, which cannot run inside "
                "CUDA-graph capture: run one eager step of every layer shape before capturing"
            )
        shapes = self._gather_objects(shape)
        if len(set(shapes)) != 1:
            raise ValueError(
                f"the ranks of the expert-parallel group called with different shapes (num_tokens, hidden, "
                f"topk, num_local_experts, dtype), in rank order: {shapes}"
            )
        self._agreed_shapes.add(shape)

    def _gather_objects(self, value: object) -> list[object]:
        values: list[object] = [None] * self.num_ranks
        dist.all_gather_object(values, value, group=self.group)
        return values

    def symmetric_pool(self) -> tuple[Optional[object], str]:
        """(the group's SymmetricPool (comm/symmetric.py), "") or (None, why not). A process group
        gets one from torch symmetric memory when its ranks are CUDA devices of one node with peer
        access and the extension is loaded. Decided from this process's view of the group only (no
        collective), and alike on every rank: torchrun gives each node LOCAL_WORLD_SIZE contiguous
        global ranks."""
        if self._pool is not None:
            return self._pool, ""
        reason = self._symmetric_unsupported_reason()
        if reason is not None:
            return None, reason
        from megatron_mok.comm.symmetric import SymmetricPool, torch_symmetric_allocator
        from megatron_mok.limits import NUM_EXCHANGE_PHASES

        self._pool = SymmetricPool(
            self.rank, self.num_ranks, NUM_EXCHANGE_PHASES, torch_symmetric_allocator(self.group), self.device
        )
        return self._pool, ""

    def _symmetric_unsupported_reason(self) -> Optional[str]:
        import os

        from megatron_mok.limits import MAX_EP_RANKS
        from megatron_mok.ops import extension_error

        if self.device.type != "cuda":
            return f"the group's tensors are on {self.device}"
        if extension_error() is not None:
            return f"the CUDA extension is not available ({extension_error()})"
        if self.num_ranks > MAX_EP_RANKS:
            return f"{self.num_ranks} ranks, more than the {MAX_EP_RANKS} of one node"
        if self.group is None:
            return "one rank has nothing to exchange"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        ranks = dist.get_process_group_ranks(self.group)
        if local < 1 or len({r // local for r in ranks}) != 1:
            return "the group spans several nodes (or LOCAL_WORLD_SIZE is unset)"
        # torchrun's convention: global rank g drives local GPU g % LOCAL_WORLD_SIZE.
        here = torch.cuda.current_device()
        for peer in sorted({r % local for r in ranks} - {here}):
            if peer >= torch.cuda.device_count() or not torch.cuda.can_device_access_peer(here, peer):
                return f"GPU {here} has no peer access to GPU {peer}"
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
