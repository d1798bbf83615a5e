"""The expert-parallel group as MoK sees it: who we are in it, and its fixed-size collectives.

One `ExpertParallelGroup` per (process group, device), created on first use and cached. The
collectives here are fixed-size (all-gather, equal-split all-to-all), so no receive count ever has
to reach the host. The group's symmetric memory (comm/placement.py) and the buffers and signals of
the in-kernel exchange are kept here too, chosen and allocated once per group (allocation and
rendezvous cannot be captured in a CUDA graph).
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
    # The group's symmetric memory (comm/placement.py), chosen at the first call that asks.
    _memory: object = dataclasses.field(default=None, repr=False, compare=False)
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
        _refuse_in_capture("the ranks agree on a layer shape at its first call")
        shapes = self.gather_objects(shape, "the shape agreement")
        if len(set(shapes)) != 1:
            raise ValueError(
                f"the ranks of the expert-parallel group called with different shapes (num_tokens, hidden, "
                f"topk, num_local_experts, dtype), in rank order: {shapes}"
            )
        self._agreed_shapes.add(shape)

    def gather_objects(self, value: object, what: str) -> list[object]:
        """Every rank's `value` (picklable), in rank order: a host all-gather over the group. A
        process group whose all-gather fails (a rank left or failed before reaching it) raises a
        RuntimeError naming this rank and `what` was being gathered."""
        try:
            return self._gather_objects(value)
        except RuntimeError as error:
            if self.group is None:
                raise
            raise RuntimeError(
                f"megatron_mok: rank {self.rank} of the expert-parallel group ({self.num_ranks} ranks): {what}: "
                f"the host all-gather over the group failed (a rank left or failed before reaching it): {error}"
            ) from error

    def _gather_objects(self, value: object) -> list[object]:
        values: list[object] = [None] * self.num_ranks
        dist.all_gather_object(values, value, group=self.group)
        return values

    def symmetric_pool(self) -> tuple[Optional[object], str]:
        """(the group's SymmetricPool (comm/symmetric.py), "") or (None, why not). A process group
        gets one where its ranks' CUDA devices can share symmetric memory and the extension is
        loaded on every rank (comm/placement.py: torch symmetric memory for one GPU per rank, CUDA
        IPC for ranks sharing a GPU). Decided once, from what every rank reports, so alike on every
        rank."""
        if self._pool is not None:
            return self._pool, ""
        reason = self._symmetric_unsupported_reason()
        if reason is not None:
            return None, reason
        memory = self.symmetric_memory()
        if memory.kind is None:
            return None, memory.why
        from megatron_mok.comm.symmetric import SymmetricPool, torch_symmetric_allocator
        from megatron_mok.limits import NUM_EXCHANGE_PHASES

        if memory.kind == "cuda_ipc":
            from megatron_mok.comm.cuda_ipc import cuda_ipc_allocator

            allocate = cuda_ipc_allocator(self)
        else:
            allocate = torch_symmetric_allocator(self.group)
        self._pool = SymmetricPool(self.rank, self.num_ranks, NUM_EXCHANGE_PHASES, allocate, self.device)
        return self._pool, ""

    def symmetric_memory(self):
        """The group's comm/placement.py SymmetricMemory: chosen at the first call, by one host
        all-gather of what every rank sees, and cached."""
        if self._memory is None:
            self._memory = self._choose_memory()
        return self._memory

    @torch.compiler.disable  # a host collective at the group's first call, outside any traced graph
    def _choose_memory(self):
        from megatron_mok.comm import placement

        _refuse_in_capture("the ranks choose their symmetric memory at the group's first call")
        return placement.choose(self.gather_objects(placement.this_rank(self.device), "the choice of symmetric memory"))

    def _symmetric_unsupported_reason(self) -> Optional[str]:
        """Why not, where this process alone can tell (and every rank alike)."""
        from megatron_mok.limits import MAX_EP_RANKS

        if self.device.type != "cuda":
            return f"the group's tensors are on {self.device}"
        if self.num_ranks > MAX_EP_RANKS:
            return f"{self.num_ranks} ranks, more than the {MAX_EP_RANKS} of one node"
        if self.group is None:
            return "one rank has nothing to exchange"
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


def _refuse_in_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"megatron_mok: {what}, which cannot run inside CUDA-graph capture: run one eager step of "
            "every layer shape before capturing"
        )


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
