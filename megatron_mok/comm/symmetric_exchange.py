"""The exchange through symmetric memory: ranks read and write each other's buffers directly.

Forward: each rank copies its top-k ids and x into its own regions and signals; every rank pulls the
group's ids (the schedule) and the rows its experts need straight from the sources' `tokens` regions
into expert order (the pull dispatch: the kernels read peer memory through the regions' pointer
tables); the experts' outputs are pushed into each source's `combine` region at slot t*K + k (the
push combine); each source sums its own slots in fixed order. Backward mirrors it: dY and the
routing weights pulled, dX rows pushed. No collective, no host synchronization: every wait is a
bounded device-side wait on the signal protocol of comm/symmetric.py, so a pass can be captured in
one CUDA graph once its regions exist.

Nothing here grows with EP: per rank the regions hold T*H (tokens, grad_tokens) and T*K*H (combine)
elements whatever the group size and the routing.
"""

from __future__ import annotations

import torch

from megatron_mok import ops
from megatron_mok.comm.exchange import GradSource, PushTarget, RowSource
from megatron_mok.comm.group import ExpertParallelGroup
from megatron_mok.comm.symmetric import SymmetricPool, SymmetricRegion
from megatron_mok.quantization import QuantizedRows, as_bf16_pairs, from_bf16_pairs
from megatron_mok.schedule import Schedule

READY, FREE = 0, 1


class SymmetricExchange:
    """The Exchange (comm/exchange.py) over a group's SymmetricPool."""

    windowed = True  # the owners push each window's rows as it is done

    def __init__(self, group: ExpertParallelGroup, pool: SymmetricPool):
        self.rank, self.num_ranks = group.rank, group.num_ranks
        self.pool = pool
        self._phases = {name: index for index, name in enumerate(ops.exchange_phase_names())}

    # ---- the signal protocol (comm/symmetric.py) ---------------------------------------------

    def _begin(self, phase: str) -> None:
        ops.exchange_begin(self.pool.calls, self.pool.signals.own, self.rank, self._phases[phase])

    def _signal(self, phase: str, kind: int) -> None:
        ops.exchange_signal(
            self.pool.calls, self.pool.signals.own, list(self.pool.signals.peer_ptrs), self.rank, self._phases[phase], kind
        )

    def _wait_ready(self, phase: str) -> None:
        ops.exchange_wait_ready(self.pool.calls, self.pool.signals.own, self.rank, self._phases[phase])

    def _publish(self, phase: str, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Call c of `phase`: wait until no peer still reads call c - 1's data, write this rank's
        regions, tell every peer, wait until every source has written its own."""
        self._begin(phase)
        for region, value in copies:
            region.copy_(value)
        self._signal(phase, READY)
        self._wait_ready(phase)

    # ---- the Exchange ------------------------------------------------------------------------

    def prepare(self, num_tokens: int, hidden: int, topk: int, dtype: torch.dtype, fp8: bool = False) -> None:
        # Every region of this shape exists before the call's first exchange op is issued: no
        # allocation (and no host wait) falls between this rank's signal waits.
        self.pool.prepare(num_tokens, hidden, topk, dtype, fp8)

    def gather_routing(self, topk_ids: torch.Tensor) -> torch.Tensor:
        num_tokens, topk = topk_ids.shape
        routing = self.pool.region("routing", num_tokens, 0, topk, torch.int64)
        self._publish("routing", [(routing.own, topk_ids)])
        ids_all = ops.gather_peer_regions(routing.own, list(routing.peer_ptrs))  # (R, T, K) int64
        self._signal("routing", FREE)
        return ids_all

    def dispatch_source(self, x: torch.Tensor | QuantizedRows) -> RowSource:
        # The group's rows in the ranks' `tokens` regions: rank r's token t at row r * T + t. FP8 rows
        # (QuantizedRows): their E4M3 bytes and scales in `fp8_tokens` and `fp8_token_scales`, under a
        # phase of their own (a backward publishes both forms of x and frees them together).
        if isinstance(x, QuantizedRows):
            values, scales = self._fp8_regions("fp8_tokens", "fp8_token_scales", x)
            self._publish("fp8_tokens", [(values.own, as_bf16_pairs(x.values)), (scales.own, x.scales)])
            return self._fp8_source(values, scales)
        tokens = self.pool.region("tokens", x.shape[0], x.shape[1], 0, x.dtype)
        self._publish("tokens", [(tokens.own, x)])
        return RowSource(tokens.own, tokens.peer_ptrs)

    def grad_source(self, grad_y: torch.Tensor | QuantizedRows, topk_weights: torch.Tensor) -> GradSource:
        # dY in the ranks' `grad_tokens` regions, (T, H) each; the routing weights in `grad_weights`,
        # (T * K,) float32 each. FP8 dY: in the `fp8_grad_*` regions with a copy of the weights, under
        # the phase fp8_grad_tokens.
        num_tokens, topk = topk_weights.shape
        weights = topk_weights.reshape(-1)
        if isinstance(grad_y, QuantizedRows):
            values, scales = self._fp8_regions("fp8_grad_tokens", "fp8_grad_token_scales", grad_y)
            grad_weights = self.pool.region("fp8_grad_weights", num_tokens, 0, topk, torch.float32)
            self._publish("fp8_grad_tokens", [
                (values.own, as_bf16_pairs(grad_y.values)), (scales.own, grad_y.scales), (grad_weights.own, weights),
            ])
            return GradSource(self._fp8_source(values, scales), RowSource(grad_weights.own, grad_weights.peer_ptrs))
        grad_tokens = self.pool.region("grad_tokens", num_tokens, grad_y.shape[1], 0, grad_y.dtype)
        grad_weights = self.pool.region("grad_weights", num_tokens, 0, topk, torch.float32)
        self._publish("grad_tokens", [(grad_tokens.own, grad_y), (grad_weights.own, weights)])
        return GradSource(RowSource(grad_tokens.own, grad_tokens.peer_ptrs), RowSource(grad_weights.own, grad_weights.peer_ptrs))

    def _fp8_regions(self, values_name: str, scales_name: str, rows: QuantizedRows):
        num_tokens, hidden = rows.values.shape
        return (self.pool.region(values_name, num_tokens, hidden, 0, torch.bfloat16),
                self.pool.region(scales_name, num_tokens, hidden, 0, torch.float32))

    @staticmethod
    def _fp8_source(values: SymmetricRegion, scales: SymmetricRegion) -> RowSource:
        # (The stages read the E4M3 view; the pulls move its bytes as the regions' bf16 pairs.)
        return RowSource(QuantizedRows(from_bf16_pairs(values.own), scales.own), values.peer_ptrs, scales.peer_ptrs)

    def release(self, source: RowSource | GradSource) -> None:
        # Every pull from the peers' regions is issued on this rank's stream: they may be reused.
        rows = source if isinstance(source, RowSource) else source.grad_y
        phase = "tokens" if isinstance(source, RowSource) else "grad_tokens"
        self._signal(("fp8_" + phase) if isinstance(rows.tensor, QuantizedRows) else phase, FREE)

    def route_index(self, schedule: Schedule, topk_ids: torch.Tensor) -> torch.Tensor:
        # The owners push route t*K + k into slot t*K + k of this rank's combine region.
        ids = topk_ids.reshape(-1)
        local_route = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64)
        return torch.where(ids >= 0, local_route, -1)

    def open_return(self, schedule: Schedule, hidden: int, dtype: torch.dtype) -> "PushedRows":
        return PushedRows(self, schedule, self.pool.region("combine", schedule.num_tokens, hidden, schedule.topk, dtype))


class PushedRows:
    """The push combine (forward) or reverse-dispatch (backward) of one call: the owners push each
    row into slot t*K + k of its source's `combine` region, window by window."""

    table_in_reused_buffer = True  # the region is the next call's

    def __init__(self, exchange: SymmetricExchange, schedule: Schedule, combine: SymmetricRegion):
        self.exchange, self.schedule, self.combine = exchange, schedule, combine
        self.freed = False
        exchange._begin("combine")  # every source finished reading its combine region's previous rows

    def push(self, slot_rows: torch.Tensor, window) -> None:
        target = self.push_target(window)
        ops.push_rows(slot_rows, target.slot_to_route, target.topk, target.num_tokens, target.own, list(target.peer_ptrs))

    def push_target(self, window) -> PushTarget:
        s = self.schedule  # (window: a receive.Window of it)
        return PushTarget(window.schedule.slot_to_route, s.topk, s.num_tokens, self.combine.own, tuple(self.combine.peer_ptrs))

    def table(self, keep: bool) -> torch.Tensor:
        self.exchange._signal("combine", READY)
        self.exchange._wait_ready("combine")  # every owner pushed this rank's rows
        if not keep:
            return self.combine.own  # read by the caller before release()
        # The table outlives the call (backward reads forward's); the region is the next call's.
        table = self.combine.own.clone()
        self.release()
        return table

    def release(self) -> None:
        if not self.freed:
            self.freed = True
            self.exchange._signal("combine", FREE)
