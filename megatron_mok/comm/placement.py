"""Which symmetric memory a process group's ranks can share, decided once and alike on every rank.

The in-kernel exchange needs every rank's regions mapped in every rank (comm/symmetric.py). Over a
process group they come from one of two allocators:

    memory             when (`auto`)                              allocator
    torch_symmetric    every rank on its own GPU                  torch symmetric memory
                                                                  (symmetric.torch_symmetric_allocator)
    cuda_ipc           ranks sharing a GPU (for tests and         CUDA IPC between the processes
                       demos: the processes time-slice it)        (cuda_ipc.cuda_ipc_allocator)

Either needs every rank on one node, peer access between every two ranks' GPUs, and the extension
on every rank; elsewhere there is none, and the reason says why. Every rank reports what it sees
(host, GPUs, peer access, the extension, the setting below) in one host all-gather over the group,
the first time the group's exchange is chosen; the decision is a function of that list alone, so
every rank takes the same one.

MEGATRON_MOK_SYMMETRIC_MEMORY=auto|torch_symmetric|cuda_ipc (the same on every rank) asks for one
allocator instead of the table's choice: an error naming why where it cannot run.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Optional

import torch

SETTING = "MEGATRON_MOK_SYMMETRIC_MEMORY"
MEMORIES = ("auto", "torch_symmetric", "cuda_ipc")


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """What one rank sees, gathered from every rank (picklable, no tensors)."""

    host: str
    device_index: int  # the rank's GPU among this process's visible GPUs
    visible_uuids: tuple[str, ...]  # this process's visible GPUs in index order, as the driver names them
    peer_uuids: tuple[str, ...]  # the GPUs this rank's GPU has peer access to
    extension_error: Optional[str]
    requested: str  # MEGATRON_MOK_SYMMETRIC_MEMORY

    @property
    def device_uuid(self) -> str:
        return self.visible_uuids[self.device_index]

    def reaches(self, other: "RankPlacement") -> bool:
        """Whether this rank's kernels can address memory on `other`'s GPU: the same GPU, or peer access."""
        return other.device_uuid == self.device_uuid or other.device_uuid in self.peer_uuids


@dataclasses.dataclass(frozen=True)
class SymmetricMemory:
    """The decision: `kind` is "torch_symmetric", "cuda_ipc" or None; `why` says what was seen
    (the reason for None, else a description for the group's one-time info line)."""

    kind: Optional[str]
    why: str


def requested_memory() -> str:
    requested = os.environ.get(SETTING, "auto")
    if requested not in MEMORIES:
        raise ValueError(f"{SETTING} must be one of {MEMORIES}, got {requested!r}")
    return requested


def this_rank(device: torch.device) -> RankPlacement:
    """This process's RankPlacement for a group whose tensors are on CUDA `device`."""
    from megatron_mok.ops import extension_error

    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))
    peers = tuple(
        visible[other] for other in range(len(visible)) if other != index and torch.cuda.can_device_access_peer(index, other)
    )
    return RankPlacement(
        host=socket.gethostname(),
        device_index=index,
        visible_uuids=visible,
        peer_uuids=peers,
        extension_error=extension_error(),
        requested=requested_memory(),
    )


def choose(ranks: list[RankPlacement]) -> SymmetricMemory:
    """The symmetric memory of a group whose ranks, in rank order, report `ranks` (the table above)."""
    requested = {r.requested for r in ranks}
    if len(requested) != 1:
        raise ValueError(
            f"{SETTING} differs between the ranks of the expert-parallel group (in rank order: "
            f"{[r.requested for r in ranks]}): set it alike on every rank"
        )
    (requested,) = requested
    for rank, placement in enumerate(ranks):
        if placement.extension_error is not None:
            return SymmetricMemory(None, f"the CUDA extension is not available on rank {rank} ({placement.extension_error})")
    if len({r.host for r in ranks}) != 1:
        return SymmetricMemory(None, f"the group spans several nodes ({sorted({r.host for r in ranks})})")
    for rank, placement in enumerate(ranks):
        for peer, other in enumerate(ranks):
            if not placement.reaches(other):
                return SymmetricMemory(None, f"rank {rank}'s GPU has no peer access to rank {peer}'s")
    devices = [r.device_uuid for r in ranks]
    shared = len(set(devices)) < len(devices)
    kind = requested if requested != "auto" else ("cuda_ipc" if shared else "torch_symmetric")
    if kind == "torch_symmetric":
        if shared:
            # Its rendezvous refuses them ("allocations from overlapping devices from different ranks").
            return SymmetricMemory(None, f"torch symmetric memory needs one GPU per rank; ranks share GPUs ({_short(devices)} in rank order)")
        return SymmetricMemory(kind, f"torch symmetric memory: {len(ranks)} GPUs of one node with peer access")
    for rank, placement in enumerate(ranks):
        for peer, other in enumerate(ranks):
            # An IPC handle names its exporter's device index; the importer opens it under that index.
            if placement.visible_uuids[other.device_index:other.device_index + 1] != (other.device_uuid,):
                return SymmetricMemory(None, f"CUDA IPC: rank {rank} sees rank {peer}'s GPU under another device index")
    if len(set(devices)) == 1:
        return SymmetricMemory(kind, f"CUDA IPC: the {len(ranks)} ranks are processes on one GPU (for tests and demos: they time-slice it)")
    return SymmetricMemory(kind, f"CUDA IPC between {len(ranks)} processes on {len(set(devices))} GPUs of one node ({SETTING}=cuda_ipc)")


def _short(uuids: list[str]) -> list[str]:
    return [u[-6:] for u in uuids]
