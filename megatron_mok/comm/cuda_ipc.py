"""Symmetric regions for the ranks of a process group that share one GPU, mapped by CUDA IPC.

torch symmetric memory refuses ranks on one device (its rendezvous: "detected allocations from
overlapping devices from different ranks"), but processes on one GPU can map each other's memory by
CUDA IPC, and one kernel per process spinning on the others' flags progresses: the processes'
contexts are time-sliced (/work/shared/DESIGN.md §8: an all-to-all flag round took 2.3 ms at R = 2
processes, 18.8 ms at R = 8). So this allocator is for testing and demos of the multi-process path,
not for speed: everything above it (SymmetricPool, the signal protocol, the exchange, every rank's
autograd in its own process) is the code a node of one process per GPU runs.

Per region, on every rank, in the same order (a collective over the group):
1. allocate this rank's copy and zero it on a side stream, then wait for that stream only (the
   current stream may hold this rank's signal waits for a previous call, which the host must
   never wait on);
2. export it with torch's CUDA tensor sharing (cudaIpcGetMemHandle of the caching allocator's
   block, the copy's offset in it; torch.multiprocessing.reductions);
3. all-gather the handles over the group on the host (ExpertParallelGroup.gather_objects): every
   copy is zero before any rank's handle arrives, so this is also the barrier before first use;
4. map every peer's copy (cudaIpcOpenMemHandle) and keep the mapping for the pool's lifetime.
"""

from __future__ import annotations

import torch

from megatron_mok.comm.group import ExpertParallelGroup
from megatron_mok.comm.symmetric import RegionAllocator, SymmetricRegion


def cuda_ipc_allocator(group: ExpertParallelGroup) -> RegionAllocator:
    """Regions whose copies are separate allocations of each rank's process, the peers' copies
    mapped by CUDA IPC (the module docstring). Collective: every rank of `group` allocates the same
    regions in the same order. Every rank's GPU is one GPU, or GPUs with peer access, and every rank
    sees each of them under the same device index (placement.py checks both): the handles name the
    exporter's device index."""
    from torch.multiprocessing.reductions import reduce_tensor

    # The peers' copies as mapped here: the mapping lives as long as these tensors, that is as
    # long as the allocator (the SymmetricPool holds it).
    mapped: list[torch.Tensor] = []

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricRegion:
        side = torch.cuda.Stream(group.device)
        with torch.cuda.stream(side):
            own = torch.zeros(shape, dtype=dtype, device=group.device)
            # (rebuild function, its arguments): plain bytes and ints, picklable for the gather.
            # torch records an IPC event on this (side) stream, which the importers' streams wait on.
            exported = reduce_tensor(own)
        side.synchronize()
        handles = group.gather_objects(exported, f"a symmetric region {tuple(shape)} {dtype}: CUDA IPC handles")
        peer_ptrs = []
        with torch.cuda.stream(side):  # the IPC events are waited on by this stream, not the current one
            for peer, (rebuild, args) in enumerate(handles):
                if peer == group.rank:
                    peer_ptrs.append(own.data_ptr())
                    continue
                copy = rebuild(*args)
                mapped.append(copy)
                peer_ptrs.append(copy.data_ptr())
        side.synchronize()
        return SymmetricRegion(own, tuple(peer_ptrs))

    return allocate
