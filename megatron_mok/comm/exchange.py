"""The exchange: every byte that crosses expert-parallel ranks in a MoK pass, as one stage.

MoK moves data between ranks at four points, and only there:

- the routing all-gather: every rank learns the group's top-k ids and builds the same schedule;
- the source of the rows the dispatch pulls (forward: x; backward: dY with the routing weights);
- the return of per-row results to the route's source rank (forward: the down projection's rows,
  the push combine; backward: the dX rows, the push reverse-dispatch), and where the source finds
  each route's row afterwards (the route index the fixed-order combine reads).

`Exchange` is that contract; `CollectiveExchange` implements it with fixed-size torch.distributed
collectives (all-gather, equal-split all-to-all), on any device and any EP size, with no receive
count on the host. The in-kernel exchange (peer pulls and pushes through symmetric memory) is
another implementation of the same contract, so it replaces this stage and nothing else.

Determinism: each route is computed by exactly one rank (the owner of its expert) and returned to
exactly one slot, so nothing is ever summed across ranks.

FP8 blockwise (docs/design.md §12): a source may be published as QuantizedRows (its rows quantized
1x128 along H where they are produced); the collective exchange then gathers the E4M3 rows and their
scales, half the bytes of bf16 rows, and the stages read them as published. The symmetric exchange
holds them in regions of their own (FP8 bytes and scales, comm/symmetric.py FP8_REGIONS), which the
pull kernels read in place; "auto" chooses between the two as for bf16 rows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Protocol, Union

import torch

from megatron_mok import ops
from megatron_mok.comm.group import ExpertParallelGroup
from megatron_mok.quantization import E4M3, QuantizedRows
from megatron_mok.schedule import Schedule

if TYPE_CHECKING:
    from megatron_mok.receive import Window

Rows = Union[torch.Tensor, QuantizedRows]  # (num_tokens, hidden) a rank publishes


@dataclasses.dataclass(frozen=True)
class RowSource:
    """Where a pull finds the group's rows: every rank's (T, *row) tensor stacked in rank order, so
    row g of the group is rank g // T's row g % T (for the tokens g = route // topk, schedule.py; for
    the routing weights g = route). The one description the stages read, whichever exchange made it.

    tensor: with peer_ptrs None, the stacked rows themselves, (R * T, *row), one tensor of this rank
    (gathered by a collective), or their QuantizedRows (FP8 values and scales, gathered alike).
    Otherwise this rank's (T, *row) copy of a symmetric region (comm/symmetric.py), and peer_ptrs
    every rank's address of its copy in rank order (this rank's among them): the kernels read the
    rows in place, over the peer mappings."""

    tensor: Union[torch.Tensor, QuantizedRows]
    peer_ptrs: Optional[tuple[int, ...]] = None
    # QuantizedRows at the peers: peer_ptrs locate the E4M3 values, these their scales.
    scale_peer_ptrs: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        quantized_at_peers = isinstance(self.tensor, QuantizedRows) and self.peer_ptrs is not None
        if quantized_at_peers != (self.scale_peer_ptrs is not None):
            raise ValueError("RowSource: scale_peer_ptrs go with QuantizedRows at the peers, and only with them")

    def materialize(self) -> Union[torch.Tensor, QuantizedRows]:
        """(R * T, *row): the stacked rows in one tensor (or QuantizedRows), for stages that need one
        (the reference)."""
        if self.peer_ptrs is None:
            return self.tensor
        if isinstance(self.tensor, QuantizedRows):
            values = ops.gather_peer_regions(self.tensor.values, list(self.peer_ptrs)).flatten(0, 1)
            scales = ops.gather_peer_regions(self.tensor.scales, list(self.scale_peer_ptrs)).flatten(0, 1)
            return QuantizedRows(values, scales)
        return ops.gather_peer_regions(self.tensor, list(self.peer_ptrs)).flatten(0, 1)


@dataclasses.dataclass(frozen=True)
class GradSource:
    """The pull reverse-combine's source: dY (R * T, H) and the routing weights (R * T * K,) float32,
    by route; both in one tensor each, or both in place at the peers."""

    grad_y: RowSource
    weights: RowSource

    def __post_init__(self) -> None:
        if (self.grad_y.peer_ptrs is None) != (self.weights.peer_ptrs is None):
            raise ValueError("GradSource: dY and the routing weights must both be gathered or both lie at the peers")

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.grad_y.materialize(), self.weights.materialize()


class Exchange(Protocol):
    rank: int
    num_ranks: int
    # Whether results may be returned window by window (receive.py); else a pass is one window.
    windowed: bool

    def prepare(self, num_tokens: int, hidden: int, topk: int, dtype: torch.dtype, fp8: bool = False) -> None:
        """Called before a layer call's first exchange: allocate what a call of this shape (and, with
        fp8, of the FP8 recipe) needs."""
        ...

    def gather_routing(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens, topk) int ids -> (num_ranks, num_tokens, topk) int64, every rank's in rank order."""
        ...

    def dispatch_source(self, x: Rows) -> RowSource:
        """(num_tokens, hidden), or its QuantizedRows -> where the group's rows can be pulled from:
        route r reads row r // topk of the group's (num_ranks * num_tokens, hidden) rows (schedule.py)."""
        ...

    def grad_source(self, grad_y: Rows, topk_weights: torch.Tensor) -> GradSource:
        """(dY (num_tokens, hidden) or its QuantizedRows, w (num_tokens, topk) fp32) -> the pull
        reverse-combine's source."""
        ...

    def release(self, source: RowSource | GradSource) -> None:
        """Every pull from `source` is issued: its buffers may be reused (a no-op for tensors)."""
        ...

    def route_index(self, schedule: Schedule, topk_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens * topk,) int64: where route t*topk+k of this rank finds its row in the table
        table of `open_return(...).table()` gives; -1 for a dropped route. Depends on the routing only (forward and
        backward share it)."""
        ...

    def open_return(self, schedule: Schedule, hidden: int, dtype: torch.dtype) -> "ReturnedRows":
        """Starts returning per-row results of `schedule` (hidden wide, dtype) to their routes' sources:
        push them window by window (all of the schedule's windows, in order), then read the table."""
        ...


@dataclasses.dataclass(frozen=True)
class PushTarget:
    """Where a window's per-row results go when a stage writes them there itself (ReturnedRows.push_target):
    row s of the window to row r % (num_tokens * topk) of rank r // (num_tokens * topk)'s region,
    r = slot_to_route[s], nothing for -1: ops.push_rows' destinations."""

    slot_to_route: torch.Tensor  # (window rows,) int64
    topk: int
    num_tokens: int
    own: torch.Tensor  # (num_tokens * topk, hidden): this rank's region
    peer_ptrs: tuple[int, ...]  # every rank's address of it, rank order


class ReturnedRows(Protocol):
    """One return of per-row results to the routes' sources (Exchange.open_return)."""

    # Whether table(keep=False)'s tensor is a buffer the exchange reuses once release()d (the
    # in-kernel exchange's combine region), so that keeping it means a copy: a caller that reads the
    # table anyway (the combine) can make that copy as it reads (functional._combine_keeping_table).
    table_in_reused_buffer: bool

    def push(self, slot_rows: torch.Tensor, window: "Window") -> None:
        """(window rows, hidden) results of a window of the schedule (receive.py), in its order."""
        ...

    def push_target(self, window: "Window") -> Optional[PushTarget]:
        """Where a stage may write the window's rows itself, in place of make-then-push() (the
        in-kernel exchange's regions: a GEMM epilogue writes there, and the window's rows are never
        in this rank's memory); None: the stage makes the rows and push() moves them."""
        ...

    def table(self, keep: bool) -> torch.Tensor:
        """After the last push: the table this rank's routes find their rows in at `route_index`.
        keep: the table must outlive the call (forward's, read again in backward): a tensor of the
        caller's own, sharing its memory with nothing the exchange or a stage still uses (backward
        may free it once read: functional._release_saved); else the caller reads it and then
        calls `release()`."""
        ...

    def release(self) -> None:
        """The table of table(keep=False) is read: its buffer may be reused."""
        ...


class CollectiveExchange:
    """The exchange over torch.distributed collectives of fixed size (any device, any EP size)."""

    # Returns all rows at once (one all-to-all): a pass over this exchange is one window.
    windowed = False

    def __init__(self, group: ExpertParallelGroup):
        self.group = group
        self.rank = group.rank
        self.num_ranks = group.num_ranks

    def gather_routing(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(topk_ids.to(torch.int64))

    def prepare(self, num_tokens: int, hidden: int, topk: int, dtype: torch.dtype, fp8: bool = False) -> None:
        pass  # the collectives allocate their outputs per call

    def _gather_rows(self, rows: Rows) -> Rows:
        """(T, C) rows of every rank, stacked in rank order: (R * T, C)."""
        if not isinstance(rows, QuantizedRows):
            return self.group.all_gather(rows).flatten(0, 1)
        # E4M3 travels as its bytes (gloo has no float8 type; the bits are what arrive).
        values = self.group.all_gather(rows.values.view(torch.uint8)).flatten(0, 1).view(E4M3)
        return QuantizedRows(values, self.group.all_gather(rows.scales).flatten(0, 1))

    def dispatch_source(self, x: Rows) -> RowSource:
        return RowSource(self._gather_rows(x))

    def grad_source(self, grad_y: Rows, topk_weights: torch.Tensor) -> GradSource:
        grad_y_all = self._gather_rows(grad_y)
        weights_all = self.group.all_gather(topk_weights).reshape(-1)
        return GradSource(RowSource(grad_y_all), RowSource(weights_all))

    def release(self, source) -> None:
        pass  # the gathered tensors are this rank's own

    def route_index(self, schedule: Schedule, topk_ids: torch.Tensor) -> torch.Tensor:
        ids = topk_ids.to(torch.int64).reshape(-1)
        if schedule.num_ranks == 1:
            # The table is this rank's own slot rows.
            return torch.where(ids >= 0, schedule.route_to_slot, -1)
        # The table is the all-to-all receive buffer: block r holds rank r's rows of this rank's
        # routes, at the route's own position.
        routes_per_rank = schedule.num_tokens * schedule.topk
        owner = torch.where(ids >= 0, ids // schedule.num_local_experts, 0)
        local_route = torch.arange(routes_per_rank, device=ids.device, dtype=torch.int64)
        return torch.where(ids >= 0, owner * routes_per_rank + local_route, -1)

    def open_return(self, schedule: Schedule, hidden: int, dtype: torch.dtype) -> "CollectiveReturn":
        return CollectiveReturn(self.group, schedule)


class CollectiveReturn:
    """The return as one equal-split all-to-all of every route's row (zeros for other owners' routes).
    Windows (a windowed subclass's, in tests) are copied into one (capacity, hidden) buffer first."""

    table_in_reused_buffer = False  # the all-to-all's output is a tensor of the caller's own

    def __init__(self, group: ExpertParallelGroup, schedule: Schedule):
        self.group, self.schedule = group, schedule
        self.slot_rows = None

    def push(self, slot_rows: torch.Tensor, window: "Window") -> None:
        if window.num_windows == 1:
            self.slot_rows = slot_rows
            return
        if self.slot_rows is None:
            self.slot_rows = slot_rows.new_empty((self.schedule.capacity, slot_rows.shape[1]))
        end = min(window.begin + window.rows, self.schedule.capacity)
        self.slot_rows[window.begin:end] = slot_rows[:end - window.begin]

    def push_target(self, window: "Window") -> None:
        return None  # the all-to-all moves one tensor of every row

    def table(self, keep: bool) -> torch.Tensor:
        schedule, slot_rows = self.schedule, self.slot_rows
        if schedule.num_ranks == 1:
            return slot_rows  # nothing moves
        hidden = slot_rows.shape[1]
        # Row `capacity` is the zero row that routes owned by other ranks read.
        padded = torch.cat((slot_rows, slot_rows.new_zeros(1, hidden)), dim=0)
        send = padded.index_select(0, schedule.route_to_slot)
        recv = self.group.all_to_all(send.view(schedule.num_ranks, schedule.num_tokens * schedule.topk, hidden))
        return recv.reshape(-1, hidden)

    def release(self) -> None:
        self.slot_rows = None  # the table is this rank's own tensor: freed with the last reference


def exchange_for(group: ExpertParallelGroup, kind: str = "auto") -> Exchange:
    """The exchange a call runs over `group` (kind: MoKConfig.exchange): through symmetric memory
    (comm/symmetric_exchange.py) when asked for, or with "auto" wherever the group offers it
    (emulated ranks; a process group whose ranks can share symmetric memory, comm/placement.py),
    else the collective one, whatever the precision (FP8 rows move through regions of their own).
    The choice depends only on the group (what every rank reported) and the config, so every rank
    of a group decides alike; a process group of CUDA ranks says once which it took and why (`exchange_notes`)."""
    if kind == "collective" or group.num_ranks == 1 and kind == "auto":
        return CollectiveExchange(group)
    pool, reason = group.symmetric_pool()
    if pool is None:
        if kind == "symmetric":
            raise ValueError(f"MoKConfig.exchange='symmetric' cannot run over this group: {reason}")
        _note_once(group, f"the collective exchange (MoKConfig.exchange='auto'): the in-kernel exchange cannot run over this group: {reason}")
        return CollectiveExchange(group)
    from megatron_mok.comm.symmetric_exchange import SymmetricExchange

    if group.group is not None:
        _note_once(group, f"the in-kernel exchange (MoKConfig.exchange={kind!r}) over {group.symmetric_memory().why}")
    return SymmetricExchange(group, pool)


# The one-time lines of exchange_for, as printed (process groups of CUDA ranks only).
exchange_notes: set[str] = set()


def _note_once(group: ExpertParallelGroup, choice: str) -> None:
    """One line per choice, on the group's rank 0, when a process group of CUDA ranks runs EP > 1:
    which exchange and why (emulated and CPU groups choose knowingly)."""
    if group.group is None or group.device.type != "cuda":
        return
    line = f"megatron_mok: EP = {group.num_ranks} runs {choice}"
    if line not in exchange_notes:
        exchange_notes.add(line)
        if group.rank == 0:
            print(line, flush=True)
