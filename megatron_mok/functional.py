"""The functional MoK layer: schedule, forward, backward, recompute — no autograd, no Megatron.

    schedule = build_schedule(topk_ids, num_local_experts=E, group=ep_group)
    y, ctx = forward(x, topk_ids, topk_weights, fc1, fc2, group=ep_group, schedule=schedule)
    grads = backward(ctx, dy, fc1, fc2)

`mok_moe` wraps these in an autograd.Function. Each pass is one fixed sequence of stages: the
backend chosen for the call (`MoKConfig.backend`, backends/) supplies the per-rank stages, and the
exchange (comm/exchange.py) everything that crosses expert-parallel ranks.

FP8 blockwise (MoKConfig.precision, docs/design.md §12) runs the same sequence with the recipe's
stages; here it changes what a rank publishes (x and dY quantized 1x128 along H where they are
produced, so the exchange moves FP8 rows), the schedule's alignment (segments padded to 128 rows for
the column-wise weight-gradient operands), what forward keeps (gate_up only: its FP8 rows and act
have no reader in backward, whose weight gradients quantize from the high-precision values), and
what backward pulls besides (dY and x in the activation dtype, the weight gradients' operands).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Optional

import torch

from megatron_mok import fp8_weights
from megatron_mok.backends import resolve_backend, stages_for
from megatron_mok.comm import Exchange, ProcessGroup, exchange_for, get_expert_parallel_group
from megatron_mok.backends.weight_grads import accumulator_for
from megatron_mok.comm.exchange import GradSource, RowSource
from megatron_mok.config import MoKConfig
from megatron_mok.limits import FP8_BLOCK
from megatron_mok.quantization import Fp8Recipe, QuantizedRows
from megatron_mok.receive import ReceivePlan, receive_plan, windows
from megatron_mok.schedule import Schedule, build_schedule_from_gathered, check_expert_id_range
from megatron_mok.validation import require_config_and_input, validate_moe_inputs


@dataclasses.dataclass
class ForwardContext:
    """What backward needs from forward."""

    schedule: Schedule
    plan: ReceivePlan  # the pass's receive windows (receive.py)
    exchange: Exchange
    backend: str
    expert_gemm: str  # MoKConfig.expert_gemm: backward runs the same GEMM family as forward
    topk_ids: torch.Tensor  # (num_tokens, topk) int
    topk_weights: torch.Tensor  # (num_tokens, topk) float32
    x: torch.Tensor  # (num_tokens, hidden): this rank's tokens, pulled again in backward when rows is None
    gate_up: torch.Tensor  # (window rows, 2 * ffn_hidden) pre-activation of the first window, its order
    # The unweighted expert output of route t*topk+k is route_table[route_index[t*topk+k]]
    # (index -1: dropped); see Exchange.route_index.
    route_table: torch.Tensor  # (num_rows, hidden)
    route_index: torch.Tensor  # (num_tokens * topk,) int64
    # Kept on one rank in one window, where they are as large as any grouped-GEMM pipeline's saved
    # activations; with several ranks (or windows) backward recomputes them. rows is also None when
    # forward dispatched through a bounded ring (MoKConfig.dispatch_ring_minibatches).
    rows: Optional[torch.Tensor]  # (capacity, hidden) dispatched rows
    act: Optional[torch.Tensor]  # (capacity, ffn_hidden) SwiGLU output
    fp8: Optional[Fp8Recipe] = None  # MoKConfig.fp8_recipe(): backward runs the same recipe
    # The activations backward may free (release_saved), as forward made them: weak references, so
    # that a tensor handed back by anything else (a saved-tensor hook's copy or buffer) is never freed.
    made: dict = dataclasses.field(default_factory=dict)

    TENSOR_FIELDS = ("topk_ids", "topk_weights", "x", "gate_up", "route_table", "route_index", "rows", "act")

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.TENSOR_FIELDS)

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> "ForwardContext":
        return dataclasses.replace(self, **dict(zip(self.TENSOR_FIELDS, tensors)))


@dataclasses.dataclass
class Grads:
    x: Optional[torch.Tensor]  # (num_tokens, hidden), x.dtype
    topk_weights: Optional[torch.Tensor]  # (num_tokens, topk) float32
    fc1: Optional[torch.Tensor]  # (num_local_experts, 2 * ffn_hidden, hidden)
    fc2: Optional[torch.Tensor]  # (num_local_experts, hidden, ffn_hidden)


def segment_alignment_for(config: MoKConfig) -> int:
    """The schedule's segment alignment: MoKConfig.segment_alignment, raised to a multiple of 128 for
    FP8 (a column-wise block of the weight gradients' operands is 128 rows of one segment)."""
    if config.precision == "fp8_blockwise":
        return math.lcm(config.segment_alignment, FP8_BLOCK)
    return config.segment_alignment


def plan_for(exchange: Exchange, num_tokens: int, topk: int, num_local_experts: int, config: MoKConfig) -> ReceivePlan:
    """The receive windows of a call (receive.py): the same on every rank of the group."""
    return receive_plan(
        num_ranks=exchange.num_ranks, num_tokens=num_tokens, topk=topk, num_local_experts=num_local_experts,
        segment_alignment=segment_alignment_for(config), factor=config.receive_capacity_factor, windowed=exchange.windowed,
    )


def _published(rows: torch.Tensor, fp8: Optional[Fp8Recipe], stages) -> torch.Tensor | QuantizedRows:
    """What a rank publishes of its (T, H) rows: the rows, or with FP8 their 1x128 quantization (the
    backend's stages.quantize_rows)."""
    return rows if fp8 is None else stages.quantize_rows(rows, fp8.pow2_scales)


def build_schedule(
    topk_ids: torch.Tensor,
    *,
    num_local_experts: int,
    group: Optional[ProcessGroup] = None,
    config: MoKConfig = MoKConfig(),
) -> Schedule:
    """All-gathers the group's routing and builds this rank's schedule (see `schedule.py`).

    Args:
        topk_ids: (num_tokens, topk) int32/int64 global expert ids, -1 = dropped; every rank of
            the group passes the same num_tokens and topk.
    """
    exchange = exchange_for(get_expert_parallel_group(group, topk_ids.device), config.exchange)
    plan = plan_for(exchange, topk_ids.shape[0], topk_ids.shape[1], num_local_experts, config)
    return _schedule_over(exchange, plan, topk_ids, num_local_experts, config)


def _schedule_over(
    exchange: Exchange, plan: ReceivePlan, topk_ids: torch.Tensor, num_local_experts: int, config: MoKConfig
) -> Schedule:
    """build_schedule over the exchange and receive plan a pass has resolved already."""
    return build_schedule_from_gathered(
        exchange.gather_routing(topk_ids),
        rank=exchange.rank,
        num_local_experts=num_local_experts,
        segment_alignment=plan.segment_alignment,
        check_expert_ids=config.check_expert_ids,
    )


def _check_schedule(schedule: Schedule, topk_ids: torch.Tensor, num_local_experts: int, exchange: Exchange, plan: ReceivePlan) -> None:
    expected = (exchange.num_ranks, exchange.rank, topk_ids.shape[0], topk_ids.shape[1], num_local_experts, plan.segment_alignment)
    got = (schedule.num_ranks, schedule.rank, schedule.num_tokens, schedule.topk, schedule.num_local_experts, schedule.segment_alignment)
    if expected != got:
        raise ValueError(
            "schedule was built for (num_ranks, rank, num_tokens, topk, num_local_experts, "
            f"segment_alignment) = {got}, but this call has {expected} (build it with build_schedule "
            "and this call's group and config)"
        )


def forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    *,
    group: Optional[ProcessGroup] = None,
    config: MoKConfig = MoKConfig(),
    schedule: Optional[Schedule] = None,
    validate: bool = True,
) -> tuple[torch.Tensor, ForwardContext]:
    """The routed experts' forward.

    Args:
        x: (num_tokens, hidden) bf16/fp32 this rank's tokens.
        topk_ids: (num_tokens, topk) int32/int64 global expert ids, -1 = dropped route.
        topk_weights: (num_tokens, topk) float32.
        fc1: (num_local_experts, 2 * ffn_hidden, hidden), gate rows then up rows.
        fc2: (num_local_experts, hidden, ffn_hidden).
        group: the expert-parallel group (None = one rank).
        schedule: from `build_schedule` on the same topk_ids; built here when None.
    Returns:
        y (num_tokens, hidden) in x.dtype, and the context for `backward`.
    """
    if validate:
        require_config_and_input(config, x)
    # The pass's group, exchange and receive plan, resolved once here and passed down: to the
    # schedule's build, the windows and the context backward reads.
    ep_group = get_expert_parallel_group(group, x.device)
    exchange = exchange_for(ep_group, config.exchange)
    if validate:
        validate_moe_inputs(x, topk_ids, topk_weights, fc1, fc2, num_ranks=exchange.num_ranks, config=config)
    backend = resolve_backend(config.backend, x, fc1, config.precision)
    fp8 = config.fp8_recipe()
    num_local_experts = fc1.shape[0]
    ep_group.agree_on_call_shape((x.shape[0], x.shape[1], topk_ids.shape[1], num_local_experts, str(x.dtype)))
    exchange.prepare(x.shape[0], x.shape[1], topk_ids.shape[1], x.dtype, fp8=fp8 is not None)
    plan = plan_for(exchange, x.shape[0], topk_ids.shape[1], num_local_experts, config)
    if schedule is None:
        schedule = _schedule_over(exchange, plan, topk_ids, num_local_experts, config)
    else:
        _check_schedule(schedule, topk_ids, num_local_experts, exchange, plan)
        if config.check_expert_ids and not schedule.expert_ids_checked and (topk_ids.device.type != "cpu" or exchange.num_ranks > 1):
            # (validate_moe_inputs checks CPU ids at EP = 1; elsewhere the schedule build does, and this
            # one skipped it. At EP > 1 a CPU rank then raises alone: the schedule's builder chose not
            # to check, which the group's own build would have done on every rank alike.)
            check_expert_id_range(topk_ids, num_local_experts * exchange.num_ranks)

    stages = stages_for(backend, config.expert_gemm, fp8)
    # Window by window (receive.py): dispatch, gate/up, down, and the push of the down rows to their
    # sources; the first window's gate/up output is kept for backward. (FP8 keeps neither rows nor act:
    # backward quantizes its weight gradients' operands from the high-precision values.)
    keep_rows = schedule.num_ranks == 1 and plan.num_windows == 1 and fp8 is None
    source = exchange.dispatch_source(_published(x, fp8, stages))
    returned = exchange.open_return(schedule, x.shape[1], x.dtype)
    # FP8 over several windows, a copy not read from the cache (without the cache, in a capture): each
    # weight quantized once for all of them.
    with fp8_weights.copies_held(fp8 is not None and plan.num_windows > 1):
        for window in windows(schedule, plan):
            # (One call per window: its buffers are freed before the next window's are allocated.)
            window_kept = _forward_window(stages, source, window, fc1, fc2, returned, config, keep_rows)
            if window.index == 0:
                rows, gate_up, act = window_kept
            del window_kept  # (a later window's gate/up is not kept)
    exchange.release(source)
    route_index = exchange.route_index(schedule, topk_ids)
    route_table, y = _combine_keeping_table(stages, returned, route_index, topk_weights, schedule.topk, x.dtype)
    ctx = ForwardContext(
        schedule=schedule,
        plan=plan,
        exchange=exchange,
        backend=backend,
        expert_gemm=config.expert_gemm,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        x=x,
        gate_up=gate_up,
        route_table=route_table,
        route_index=route_index,
        rows=rows,  # (None after a ring)
        act=act,
        fp8=fp8,
    )
    if not torch.compiler.is_compiling():  # (inside torch.compile nothing is freed: _release_saved)
        ctx.made = {name: weakref.ref(t) for name in RELEASED_FIELDS if (t := getattr(ctx, name)) is not None}
    return y, ctx


def _combine_keeping_table(stages, returned, route_index, topk_weights, topk: int, dtype: torch.dtype):
    """-> (the route table backward reads, y). Where the table lies in a buffer the exchange reuses
    (the in-kernel exchange's combine region), the combine writes backward's copy of every row it
    reads as it reads it, and the region is released after it: the copy costs its writes, not a
    read of the region of its own."""
    if not returned.table_in_reused_buffer:
        route_table = returned.table(keep=True)
        return route_table, stages.combine(route_table, route_index, topk_weights, topk, dtype)
    region = returned.table(keep=False)
    try:
        route_table = torch.empty_like(region)
        y = stages.combine(region, route_index, topk_weights, topk, dtype, keep=route_table)
    finally:  # (a failed combine still frees the region: the peers' next call waits for it)
        returned.release()
    return route_table, y


def _forward_window(stages, source, window, fc1, fc2, returned, config: MoKConfig, keep_rows: bool):
    """One window of forward: dispatch, gate/up + SwiGLU, down, push. -> (rows or None, gate_up,
    act or None): what the context keeps of it when it is the first window."""
    offsets = window.schedule.expert_offsets
    rows, gate_up, act = stages.dispatch_gate_up(source, window.schedule, fc1, config.dispatch_ring_minibatches)
    _return_rows(returned, window, stages.expert_down, stages.expert_down_pushed, act, fc2, offsets)
    return (rows if keep_rows else None), gate_up, (act if keep_rows else None)


def _return_rows(returned, window, stage, pushed_stage, *args) -> None:
    """A window's rows of `stage(*args)` to their sources: written into the exchange's push target by
    the stage's pushing form (pushed_stage(*args, target)) where the backend has one and the exchange
    offers a target, else made by the stage and pushed."""
    target = returned.push_target(window) if pushed_stage is not None else None
    if target is not None:
        pushed_stage(*args, target)
    else:
        returned.push(stage(*args), window)


def recompute_forward_context(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    *,
    group: Optional[ProcessGroup] = None,
    config: MoKConfig = MoKConfig(),
    schedule: Optional[Schedule] = None,
) -> ForwardContext:
    """Rebuilds the forward context for activation checkpointing (the output is discarded)."""
    return forward(x, topk_ids, topk_weights, fc1, fc2, group=group, config=config, schedule=schedule)[1]


def backward(
    ctx: ForwardContext,
    grad_y: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    *,
    need_input_grads: bool = True,
    need_weight_grads: bool = True,
    release_saved: bool = False,
) -> Grads:
    """The routed experts' backward.

    Args:
        grad_y: (num_tokens, hidden) gradient of y, in y's dtype.
        release_saved: free each activation forward kept in ctx as soon as its last reader has
            run, and drop it from ctx: the route table once d topk_weights has read it (before
            anything else of backward is allocated), the first window's gate/up and act once the fc2
            weight gradient has read them. The context then serves no further backward. The caller
            says they are held nowhere else (`mok_moe`'s autograd function, whose saved tensors
            would otherwise keep them to backward's end). memory.py's bound counts the route table
            freed.
    Returns:
        Grads; d x and d topk_weights when need_input_grads, d fc1 and d fc2 when
        need_weight_grads (None otherwise). Each reduction has a fixed order, so the gradients are
        bitwise reproducible.
    """
    schedule, exchange = ctx.schedule, ctx.exchange
    for name in RELEASED_FIELDS:
        tensor = getattr(ctx, name)
        freed = (tensor is not None and not torch.compiler.is_compiling() and tensor.numel() > 0
                 and tensor.untyped_storage().nbytes() == 0)
        if (name == "route_table" and tensor is None) or freed:
            raise ValueError(
                f"ctx: its {name} was released by an earlier backward (release_saved=True); a context serves "
                "one backward then (mok_moe: backward twice through one call, retain_graph=True, or again after "
                "a backward that failed, is not supported)"
            )
    if grad_y.shape != ctx.x.shape:
        raise ValueError(f"grad_y must be {tuple(ctx.x.shape)}, got {tuple(grad_y.shape)}")
    grad_y = grad_y.to(ctx.x.dtype).contiguous()
    fp8 = ctx.fp8
    stages = stages_for(ctx.backend, ctx.expert_gemm, fp8)
    topk = schedule.topk
    passes = windows(schedule, ctx.plan)
    crosses_ranks = exchange.num_ranks > 1

    d_weights = None
    if need_input_grads:
        d_weights = stages.route_weight_grads(grad_y, ctx.route_table, ctx.route_index, topk)
    if release_saved:
        _release_saved(ctx, "route_table")
    sources = _backward_sources(exchange, ctx, grad_y, len(passes) > 1, need_weight_grads, stages)
    # The dX rows go back to their sources (the push reverse-dispatch).
    returned = exchange.open_return(schedule, ctx.x.shape[1], ctx.x.dtype) if (need_input_grads or crosses_ranks) else None
    d_x = None
    d_fc1, d_fc2 = (
        accumulator_for(
            stages.weight_grad_family, stages.segment_weight_grad, len(passes), stages.weight_grad_into, stages.weight_grad_window
        )
        for _ in range(2)
    )
    # FP8 on the kernels: each window's weight copies are of its experts with rows alone, made for
    # their GEMMs and freed after them, so none is held across the windows (fp8_weights). The reference
    # backend's copies are whole weights: without the cache, one of each is held for all the windows
    # rather than made again in every one.
    hold = fp8 is not None and ctx.backend == "reference" and len(passes) > 1
    with fp8_weights.copies_held(hold):
        for window in passes:
            # (One call per window: its buffers are freed before the next window's are allocated.)
            window_d_x = _backward_window(
                stages, ctx, window, sources, returned, fc1, fc2, d_fc1, d_fc2,
                need_input_grads, need_weight_grads, grad_y.dtype, release_saved,
            )
            if window.last:
                d_x = window_d_x
    sources.release(exchange)

    return Grads(
        x=d_x,
        topk_weights=d_weights,
        fc1=d_fc1.result() if need_weight_grads else None,
        fc2=d_fc2.result() if need_weight_grads else None,
    )


# The activations forward keeps that backward frees after their last readers (release_saved).
RELEASED_FIELDS = ("route_table", "gate_up", "act")


def _release_saved(ctx: ForwardContext, name: str) -> None:
    """Drops ctx's tensor `name` (of RELEASED_FIELDS) and frees its memory now (backward's
    release_saved).

    Its storage is freed by resizing it to nothing, since autograd's saved tensors hold the tensor
    itself to backward's end. Only the tensor forward made (ctx.made: not a saved-tensor hook's copy
    or buffer, which its hook may still use) and only one that covers its storage exactly (the
    exchanges' `ReturnedRows.table(keep=True)` returns a table of its own, and the combine's kept
    copy is one; the stages return fresh tensors) is freed so; any other is only dropped. Inside
    torch.compile the compiled graph owns the saved tensors' lifetimes, and the tensor is only
    dropped too."""
    tensor = getattr(ctx, name)
    setattr(ctx, name, None)
    made = ctx.made.get(name)
    if tensor is None or made is None or made() is not tensor or torch.compiler.is_compiling():
        return
    storage = tensor.untyped_storage()
    if tensor.storage_offset() == 0 and tensor.is_contiguous() and storage.nbytes() == tensor.numel() * tensor.element_size():
        # The caching allocator takes the block back ordered after its readers' kernels on this stream.
        storage.resize_(0)


@dataclasses.dataclass(frozen=True)
class _BackwardSources:
    """What a backward pass pulls rows from. Without FP8 one source of each serves every stage;
    with FP8 the dgrads read FP8 dY and the gate/up recompute FP8 x, the weight gradients dY and x in
    the activation dtype (§12.4: their operands are quantized from the high-precision values)."""

    grad: GradSource  # dY for the down dgrad
    grad_for_weights: Optional[GradSource]  # dY for the fc2 weight gradient
    rows: Optional[RowSource]  # x for the fc1 weight gradient
    rows_for_gate_up: Optional[RowSource]  # x for the gate/up of windows after the first

    def release(self, exchange: Exchange) -> None:
        released = []
        for source in (self.grad, self.grad_for_weights, self.rows, self.rows_for_gate_up):
            if source is not None and not any(source is done for done in released):
                exchange.release(source)
                released.append(source)


def _backward_sources(
    exchange: Exchange, ctx: ForwardContext, grad_y: torch.Tensor, recompute: bool, need_weight_grads: bool, stages
) -> _BackwardSources:
    """Publishes what backward pulls. What crosses ranks runs on every rank at EP > 1, whatever its
    own requires_grad flags say: a rank that skipped it would leave the others waiting. Whether
    forward kept its rows depends on the shapes, the ring, the EP size and the precision only, so it
    is the same on every rank."""
    fp8, crosses_ranks = ctx.fp8, exchange.num_ranks > 1
    grad = exchange.grad_source(_published(grad_y, fp8, stages), ctx.topk_weights)
    if fp8 is None:
        # The rows again, for the fc1 weight gradient and for the gate/up of every window after the first.
        pull_rows = ctx.rows is None and (need_weight_grads or crosses_ranks or recompute)
        rows = exchange.dispatch_source(ctx.x) if pull_rows else None
        return _BackwardSources(grad, grad, rows, rows)
    for_weights = need_weight_grads or crosses_ranks
    return _BackwardSources(
        grad=grad,
        grad_for_weights=exchange.grad_source(grad_y, ctx.topk_weights) if for_weights else None,
        rows=exchange.dispatch_source(ctx.x) if for_weights else None,
        rows_for_gate_up=exchange.dispatch_source(_published(ctx.x, fp8, stages)) if recompute else None,
    )


def _backward_window(
    stages, ctx: ForwardContext, window, sources: _BackwardSources, returned, fc1, fc2, d_fc1, d_fc2,
    need_input_grads: bool, need_weight_grads: bool, dtype: torch.dtype, release_saved: bool,
) -> Optional[torch.Tensor]:
    """One window of backward: pull dY, the down dgrad with the SwiGLU backward, the fc2 weight
    gradient's share, the gate/up dgrad and its push, the fc1 weight gradient's share. -> d x after
    the last window's push. Ordered so that few window-sized buffers are alive at once: each is
    dropped as soon as its last reader ran, and the rows are pulled only for the fc1 gradient."""
    offsets = window.schedule.expert_offsets
    rows = ctx.rows if window.index == 0 else None
    if window.index == 0:
        gate_up, act = ctx.gate_up, ctx.act
    else:  # recomputed: forward kept only the first window's gate/up (receive.py). Its rows and act
        # are dropped at once (the rows are pulled again for the fc1 gradient, act made again from
        # gate/up: the SwiGLU kernels and the GEMM epilogue's give the same bits).
        gate_up, act = _recompute_gate_up(stages, sources.rows_for_gate_up, window.schedule, fc1), None
    grad_slot_out = stages.pull_route_grads(sources.grad, window.schedule)
    if need_weight_grads and act is None and stages.dgrad_swiglu_and_act is not None:
        grad_gate_up, act = stages.dgrad_swiglu_and_act(grad_slot_out, fc2, gate_up, offsets)
    else:
        grad_gate_up = stages.dgrad_swiglu(grad_slot_out, fc2, gate_up, offsets)
        if need_weight_grads and act is None:
            act = (stages.weight_grad_act or stages.swiglu)(gate_up, offsets)
    # gate/up's last readers, the SwiGLU backward and act's, ran: freed before the fc2 weight
    # gradient's operands are pulled.
    gate_up = None
    if release_saved and window.index == 0:
        _release_saved(ctx, "gate_up")
    if need_weight_grads:
        if sources.grad_for_weights is not sources.grad:  # (FP8: the dgrad's rows were FP8)
            grad_slot_out = None  # (freed before the rows in the activation dtype are pulled)
            grad_slot_out = (stages.weight_grad_route_grads or stages.pull_route_grads)(sources.grad_for_weights, window.schedule)
        d_fc2.add(grad_slot_out, act, window)
    del grad_slot_out, act
    if release_saved and window.index == 0:  # its last reader, d fc2, ran
        _release_saved(ctx, "act")
    d_x = None
    if returned is not None:
        _return_rows(returned, window, stages.dgrad_rows, stages.dgrad_rows_pushed, grad_gate_up, fc1, offsets)
        if window.last:  # summed before the rows are pulled again, so the dX rows are freed first
            d_x = _return_grad_x(returned, ctx, stages, need_input_grads, dtype)
    if need_weight_grads:
        if rows is None:
            rows = (stages.weight_grad_rows or stages.dispatch_rows)(sources.rows, window.schedule)
        d_fc1.add(grad_gate_up, rows, window)
    return d_x


def _recompute_gate_up(stages, source, schedule: Schedule, fc1: torch.Tensor) -> torch.Tensor:
    """A window's gate_up made again in backward: the backend's recompute_gate_up (no act), else
    dispatch_gate_up's with its rows and act dropped."""
    if stages.recompute_gate_up is not None:
        return stages.recompute_gate_up(source, schedule, fc1)
    return stages.dispatch_gate_up(source, schedule, fc1, 0)[1]


def _return_grad_x(returned, ctx: ForwardContext, stages, need_input_grads: bool, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """After the last window's push: d x, every route's dX row summed over k in fixed order."""
    table = returned.table(keep=False)
    d_x = stages.combine(table, ctx.route_index, None, ctx.schedule.topk, dtype) if need_input_grads else None
    returned.release()
    return d_x
