"""Backward frees the route table once its one reader (d topk_weights) ran
(functional.backward(release_route_table=True), as mok_moe runs it): what is freed, that nothing else
is, that the gradients do not change, and that a second backward through the same call is an error
named before anything runs. The memory it saves is counted by memory.py's bound (test_memory.py)
and measured on the GPU (tests/comm/test_gpu_fp8_memory.py, test_gpu_emulation.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import MoKConfig, mok_moe
from megatron_mok import functional

from test_fp8_layer import SHAPES as FP8_SHAPES
from test_mok_moe import SHAPES, make_inputs


def _saved_by_autograd(run):
    """Runs `run` under identity saved-tensor hooks: -> (its result, every tensor autograd saved)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return run(), saved


@pytest.mark.parametrize("precision", ["bf16", "fp8_blockwise"])
def test_mok_moe_backward_frees_the_route_table_alone(precision):
    # (FP8: H and F multiples of 128.)
    shape = SHAPES["tiny_model"] if precision == "bf16" else FP8_SHAPES["small"]
    x, ids, weights, fc1, fc2, grad = make_inputs(shape, "dropped", torch.float32, seed=5)
    config = MoKConfig(precision=precision)
    leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]
    y, saved = _saved_by_autograd(lambda: mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], config=config))
    sizes = [t.untyped_storage().nbytes() for t in saved]
    y.backward(grad)
    freed = [i for i, t in enumerate(saved) if t.untyped_storage().nbytes() == 0 and sizes[i] > 0]
    # Exactly one saved tensor freed: the route table, (rows of the table, hidden) in x's dtype.
    assert len(freed) == 1, [tuple(saved[i].shape) for i in freed]
    table = saved[freed[0]]
    assert table.dim() == 2 and table.shape[1] == x.shape[1] and table.dtype == x.dtype

    # The gradients are those of a backward that keeps the table.
    y2, ctx = functional.forward(x, ids, weights, fc1, fc2, config=config)
    kept = functional.backward(ctx, grad, fc1, fc2)
    assert ctx.route_table is not None and ctx.route_table.untyped_storage().nbytes() > 0
    for name, got, want in (("x", leaves[0].grad, kept.x), ("topk_weights", leaves[1].grad, kept.topk_weights),
                            ("fc1", leaves[2].grad, kept.fc1), ("fc2", leaves[3].grad, kept.fc2)):
        assert torch.equal(got, want), f"d{name} with the table released vs kept"
    assert torch.equal(y.detach(), y2)


def test_a_released_context_serves_no_second_backward():
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["small"], "uniform", torch.float32, seed=6)
    _, ctx = functional.forward(x, ids, weights, fc1, fc2)
    first = functional.backward(ctx, grad, fc1, fc2, release_route_table=True)
    assert ctx.route_table is None and first.topk_weights is not None
    with pytest.raises(ValueError, match="ctx: its route table was released"):
        functional.backward(ctx, grad, fc1, fc2)


def test_backward_twice_through_one_call_is_a_runtime_error_naming_retain_graph():
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["small"], "uniform", torch.float32, seed=7)
    leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]
    y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    y.backward(grad, retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.backward(grad)


def test_a_table_sharing_its_storage_is_dropped_not_freed():
    """A table that is a view into a larger buffer (not what the exchanges return, but what the contract
    cannot rule out for a backend) is only dropped from the context: the buffer stays whole."""
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["small"], "uniform", torch.float32, seed=8)
    _, ctx = functional.forward(x, ids, weights, fc1, fc2)
    rows = ctx.route_table.shape[0]
    buffer = torch.cat((ctx.route_table, torch.randn(3, x.shape[1])))
    ctx.route_table = buffer[:rows]
    functional.backward(ctx, grad, fc1, fc2, release_route_table=True)
    assert ctx.route_table is None and buffer.untyped_storage().nbytes() == buffer.numel() * buffer.element_size()
