"""The symmetric buffers of the in-kernel exchange: one layout, the same on every rank, and the pointer
tables through which a rank's kernels read and write its peers' copies.

Layout of one rank's buffer for a layer call of num_tokens T, hidden H, topk K and activation dtype
(bytes; every region 256-byte aligned; `regions()` computes the offsets, nothing else does):

    routing      T*K*8        int64   this rank's top-k ids, pulled by every rank (schedule)
    tokens       T*H*s        dtype   the rows dispatch pulls: x in forward (and in backward when
                                      forward did not keep its dispatched rows)
    grad_tokens  T*H*s        dtype   dY, pulled by the experts' owners in backward
    grad_weights T*K*4        float32 the routing weights, pulled with dY (w * dY per route)
    combine      T*K*H*s      dtype   rows pushed back by the experts' owners at slot t*K + k:
                                      forward's expert outputs, backward's dX rows
    signals      P*2*R*8      uint64  signal pad: [phase][kind][source rank] counters, kind 0 =
                                      ready (source wrote), 1 = free (source finished reading)

(s = the dtype's size, R = ranks, P = exchange phases, csrc/moe/ exchange header names them.)

Signals are monotonically increasing counts, one per (phase, kind, source): call c of a phase waits
for `ready >= c` from every source before reading, and for `free >= c - 1` from every peer before
overwriting what the peers may still read from the previous call. Each rank keeps its own per-phase
call count on the device (`calls`), so the protocol needs no reset kernel, replays in a CUDA graph,
and a stale count can never read as fresh. Every wait is bounded (csrc/common/ watchdog) and names
the phase, the kind, the peer and the call when it times out.

Buffers are allocated once per (group, T, H, K, dtype), outside any CUDA graph capture, and shared
by every layer: the phase protocol orders the layers' uses of the same regions.
"""

from __future__ import annotations

import dataclasses

import torch

_ALIGN = 256
REGION_NAMES = ("routing", "tokens", "grad_tokens", "grad_weights", "combine", "signals")


@dataclasses.dataclass(frozen=True)
class SymmetricLayout:
    num_tokens: int
    hidden: int
    topk: int
    dtype: torch.dtype
    num_ranks: int
    num_phases: int

    def region_bytes(self) -> dict[str, int]:
        t, h, k = self.num_tokens, self.hidden, self.topk
        s = torch.empty((), dtype=self.dtype).element_size()
        return {
            "routing": t * k * 8,
            "tokens": t * h * s,
            "grad_tokens": t * h * s,
            "grad_weights": t * k * 4,
            "combine": t * k * h * s,
            "signals": self.num_phases * 2 * self.num_ranks * 8,
        }

    def regions(self) -> dict[str, tuple[int, int]]:
        """{name: (offset, bytes)} of every region in one rank's buffer."""
        out, offset = {}, 0
        for name, size in self.region_bytes().items():
            out[name] = (offset, size)
            offset += -(-size // _ALIGN) * _ALIGN
        return out

    @property
    def total_bytes(self) -> int:
        offset, size = self.regions()["signals"]
        return offset + size


@dataclasses.dataclass
class SymmetricBuffers:
    """One rank's view of the group's symmetric buffers."""

    layout: SymmetricLayout
    rank: int
    buffer: torch.Tensor  # (total_bytes,) uint8: this rank's buffer (peers read and write it too)
    peer_bases: list[int]  # device address of every rank's buffer, in rank order
    calls: torch.Tensor  # (num_phases,) int64 on the device: this rank's call count per phase

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        offset, size = self.layout.regions()[name]
        count = size // torch.empty((), dtype=dtype).element_size()
        return self.buffer[offset:offset + size].view(dtype)[:count].view(shape)

    def peer_pointers(self, name: str) -> list[int]:
        """The address of region `name` in every rank's buffer, in rank order."""
        offset, _ = self.layout.regions()[name]
        return [base + offset for base in self.peer_bases]

    def signals(self) -> torch.Tensor:
        """(num_phases, 2, num_ranks) uint64 as int64: this rank's signal pad."""
        layout = self.layout
        return self.view("signals", (layout.num_phases, 2, layout.num_ranks), torch.int64)


def allocate_emulated(layout: SymmetricLayout, device: torch.device) -> list[SymmetricBuffers]:
    """Every rank's buffers in one process (megatron_mok.emulation): separate allocations on one
    device, with the peer table pointing at them, as torch symmetric memory gives one per GPU. The
    signal pads start at zero; everything else starts undefined (NaN-like garbage must never be
    read: every region is written before its ready signal)."""
    buffers = [torch.empty(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(layout.num_ranks)]
    bases = [b.data_ptr() for b in buffers]
    out = []
    for rank, buffer in enumerate(buffers):
        sym = SymmetricBuffers(layout, rank, buffer, bases, torch.zeros(layout.num_phases, dtype=torch.int64, device=device))
        sym.signals().zero_()
        out.append(sym)
    return out


def allocate_torch_symmetric(layout: SymmetricLayout, group, rank: int, device: torch.device) -> SymmetricBuffers:
    """This process's buffers from torch symmetric memory over `group` (one process per GPU, one node
    with peer access). Collective: every rank of the group calls it with the same layout. Multicast
    is never used (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before the first allocation; no
    multimem op is ever called)."""
    import os

    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    buffer = symm_mem.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name if hasattr(group, "group_name") else group)
    sym = SymmetricBuffers(layout, rank, buffer, list(handle.buffer_ptrs), torch.zeros(layout.num_phases, dtype=torch.int64, device=device))
    sym.signals().zero_()
    torch.cuda.synchronize(device)
    # Every pad is zero before any rank signals. A plain collective barrier: the symmetric handle's
    # own barrier may pick a multicast kernel, which our machines forbid.
    torch.distributed.barrier(group)
    return sym
