"""The symmetric buffers of the in-kernel exchange: every region and signal, described once.

A region exists on every rank of the group with the same shape and dtype; a rank's kernels read and
write its peers' copies through `SymmetricRegion.peer_ptrs` (device addresses, rank order). Per
layer call of num_tokens T, hidden H, topk K, activation dtype D (s = its size in bytes), R ranks:

    region        shape        dtype    bytes        what
    routing       (T, K)       int64    8*T*K        this rank's top-k ids, pulled by every rank
    tokens        (T, H)       D        s*T*H        the rows dispatch pulls (x; again in backward
                                                     when forward did not keep its dispatched rows)
    grad_tokens   (T, H)       D        s*T*H        dY, pulled by the experts' owners in backward
    grad_weights  (T*K,)       float32  4*T*K        the routing weights, pulled with dY
    combine       (T*K, H)     D        s*T*K*H      rows pushed back by the experts' owners into
                                                     slot t*K + k: forward's expert outputs,
                                                     backward's dX rows
    signals       (P, 2, R)    int64    16*P*R       [phase][kind][source] counters; kind 0 =
                                                     ready (the source wrote), 1 = free (it
                                                     finished reading); P = the exchange's phases

So a rank holds 2*s*T*H + s*T*K*H + 12*T*K + 16*P*R bytes of symmetric memory per distinct
(T, H, K, D), whatever EP and whatever the routing; every layer of that shape shares them (the
phase protocol orders their uses).

Signals are counts that only grow, one per (phase, kind, source). Call c of a phase on a rank: wait
until every peer's `free` count is >= c - 1 (nobody still reads what the previous call left), write,
signal `ready` to every peer, wait until every source's `ready` is >= c, read, signal `free`. Each
rank keeps its per-phase call count on the device (`calls`), so there is no reset kernel, CUDA-graph
replays work, and a stale count can never read as fresh. Every wait is bounded and names the phase,
the kind, the peer and the call on timeout (ops.last_failure()).

Regions are allocated on first use, outside any CUDA-graph capture, and cached per group.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Callable

import torch

# name: (shape from (T, H, K), dtype from the activation dtype D)
REGIONS: dict[str, Callable[[int, int, int, torch.dtype], tuple[tuple[int, ...], torch.dtype]]] = {
    "routing": lambda t, h, k, d: ((t, k), torch.int64),
    "tokens": lambda t, h, k, d: ((t, h), d),
    "grad_tokens": lambda t, h, k, d: ((t, h), d),
    "grad_weights": lambda t, h, k, d: ((t * k,), torch.float32),
    "combine": lambda t, h, k, d: ((t * k, h), d),
}
# FP8 blockwise calls (MoKConfig.precision) also publish their E4M3 rows and scales (comm/
# symmetric_exchange.py). The E4M3 bytes of a (T, H) row block are held as (T, H/2) bf16 pairs: the
# pull kernels move bf16 and fp32 rows and copy a pair's 16 bits unchanged (H is a multiple of 128).
FP8_REGIONS: dict[str, Callable[[int, int, int, torch.dtype], tuple[tuple[int, ...], torch.dtype]]] = {
    "fp8_tokens": lambda t, h, k, d: ((t, h // 2), torch.bfloat16),
    "fp8_token_scales": lambda t, h, k, d: ((t, h // 128), torch.float32),
    "fp8_grad_tokens": lambda t, h, k, d: ((t, h // 2), torch.bfloat16),
    "fp8_grad_token_scales": lambda t, h, k, d: ((t, h // 128), torch.float32),
    "fp8_grad_weights": lambda t, h, k, d: ((t * k,), torch.float32),
}


# Every region by name: what SymmetricPool.region looks a name up in.
ALL_REGIONS = {**REGIONS, **FP8_REGIONS}


def _tables(fp8: bool) -> dict:
    return ALL_REGIONS if fp8 else REGIONS


def symmetric_bytes_per_rank(
    num_tokens: int, hidden: int, topk: int, dtype: torch.dtype, num_ranks: int, num_phases: int, fp8: bool = False
) -> int:
    """Bytes of symmetric memory one rank holds for one (T, H, K, D): the tables above (FP8_REGIONS
    with fp8)."""
    total = 16 * num_phases * num_ranks
    for shape_of in _tables(fp8).values():
        shape, region_dtype = shape_of(num_tokens, hidden, topk, dtype)
        total += torch.Size(shape).numel() * torch.empty((), dtype=region_dtype).element_size()
    return total


@dataclasses.dataclass(frozen=True)
class SymmetricRegion:
    own: torch.Tensor  # this rank's copy (peers read and write it too)
    peer_ptrs: tuple[int, ...]  # the device address of every rank's copy, in rank order


# Allocates one region on every rank, zeroed everywhere before any rank can use it:
# (shape, dtype) -> this rank's SymmetricRegion.
RegionAllocator = Callable[[tuple[int, ...], torch.dtype], SymmetricRegion]


class SymmetricPool:
    """One rank's symmetric regions and signals, allocated on first use and cached."""

    def __init__(self, rank: int, num_ranks: int, num_phases: int, allocate: RegionAllocator, device: torch.device):
        self.rank, self.num_ranks, self.num_phases = rank, num_ranks, num_phases
        self._allocate = allocate
        self._regions: dict[tuple, SymmetricRegion] = {}
        self.signals = self._new((num_phases, 2, num_ranks), torch.int64)
        self.calls = torch.zeros(num_phases, dtype=torch.int64, device=device)  # local, not symmetric

    def _new(self, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricRegion:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "megatron_mok: symmetric buffers are allocated on a layer's first call, which cannot run "
                "inside CUDA-graph capture: run one eager step of every layer shape before capturing"
            )
        return self._allocate(shape, dtype)

    def prepare(self, num_tokens: int, hidden: int, topk: int, dtype: torch.dtype, fp8: bool = False) -> None:
        """Allocates every region a layer call of this shape uses (REGIONS, then with fp8 FP8_REGIONS,
        in table order: every rank asks in the same order)."""
        for name in _tables(fp8):
            self.region(name, num_tokens, hidden, topk, dtype)

    def region(self, name: str, num_tokens: int, hidden: int, topk: int, dtype: torch.dtype) -> SymmetricRegion:
        shape, region_dtype = ALL_REGIONS[name](num_tokens, hidden, topk, dtype)
        key = (name, shape, region_dtype)
        region = self._regions.get(key)
        if region is None:
            region = self._regions[key] = self._new(shape, region_dtype)
        return region


def emulated_allocator(num_ranks: int, device: torch.device) -> Callable[[int], RegionAllocator]:
    """Every rank's regions in one process (megatron_mok.emulation): separate allocations on one
    device, the peer table pointing at them, as torch symmetric memory gives one per GPU. The first
    rank to ask for a region allocates it for all ranks (the ranks ask in the same order).

    NOTES: nothing may wait on the host once a rank's pass is launched: its stream may hold a
    signal wait for ranks not launched yet, and any host wait (a stream synchronization, an
    allocation that synchronizes the device) would then never end. So the regions are allocated up
    front (EmulatedGroup.prepare) and `SymmetricPool.region` only looks them up during a pass."""
    allocated: dict[tuple, list[torch.Tensor]] = {}
    counts: dict[tuple, int] = {}
    lock = threading.Lock()  # ranks in threads (EmulatedGroup.run) may ask at once
    def for_rank(rank: int) -> RegionAllocator:
        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricRegion:
            with lock:
                return locked_allocate(shape, dtype)

        def locked_allocate(shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricRegion:
            # The n-th request for a (shape, dtype) on every rank is the same region.
            n = counts.get((rank, shape, dtype), 0)
            counts[(rank, shape, dtype)] = n + 1
            key = (shape, dtype, n)
            if key not in allocated:
                # Zeroed on the asking stream, which has nothing pending: the regions are allocated
                # before any rank is launched (EmulatedGroup.prepare), and the ranks' streams are
                # forked from that stream after it.
                allocated[key] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_ranks)]
            copies = allocated[key]
            return SymmetricRegion(copies[rank], tuple(c.data_ptr() for c in copies))

        return allocate

    return for_rank


def torch_symmetric_allocator(group) -> RegionAllocator:
    """Regions from torch symmetric memory over `group` (one process per GPU of one node with peer
    access). Collective: every rank allocates the same regions in the same order. NVLink multicast
    is never used: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before the first allocation, no
    multimem op is called, and the one barrier is a plain collective."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricRegion:
        own = symm_mem.empty(shape, dtype=dtype, device=torch.cuda.current_device())
        handle = symm_mem.rendezvous(own, group.group_name)
        side = torch.cuda.Stream()  # not the current stream: it may hold this rank's pending waits
        with torch.cuda.stream(side):
            own.zero_()
        side.synchronize()
        dist.barrier(group)  # every rank's copy exists and is zero before any rank uses it
        return SymmetricRegion(own, tuple(handle.buffer_ptrs))

    return allocate
