"""Backward frees each activation forward kept once its last reader has run
(functional.backward(release_saved=True), as mok_moe runs it): the route table after d topk_weights,
the first window's gate/up and act after the fc2 weight gradient. What is freed, that nothing else
is, that the gradients do not change, and that a second backward through the same call is an error
named before anything runs. The memory it saves is counted by memory.py's bound (test_memory.py) and
measured on the GPU (tests/comm/test_gpu_fp8_memory.py, test_gpu_emulation.py,
scripts/memory_stages.py)."""

from __future__ import annotations

import weakref

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


def _forward_storages(monkeypatch) -> list:
    """The storage of every tensor in each ForwardContext functional.forward returns from here on, by
    field name (the storages only: the test holds no tensor, so the saved tensors are forward's alone)."""
    made = []
    forward = functional.forward

    def recording(*args, **kwargs):
        y, ctx = forward(*args, **kwargs)
        made.append({name: t.untyped_storage() for name in ctx.TENSOR_FIELDS if (t := getattr(ctx, name)) is not None})
        return y, ctx

    monkeypatch.setattr(functional, "forward", recording)
    return made


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp8_blockwise"])
def test_mok_moe_backward_frees_the_kept_activations_alone(monkeypatch, precision, hooks):
    """Without saved-tensor hooks (the tensors autograd hands back are forward's own objects, kept alive
    by autograd alone) and with identity hooks: exactly the route table, gate/up and (BF16) act are
    freed, and nothing else forward kept or autograd saved."""
    # (FP8: H and F multiples of 128.)
    shape = SHAPES["tiny_model"] if precision == "bf16" else FP8_SHAPES["small"]
    x, ids, weights, fc1, fc2, grad = make_inputs(shape, "dropped", torch.float32, seed=5)
    config = MoKConfig(precision=precision)
    _, ctx = functional.forward(x, ids, weights, fc1, fc2, config=config)
    grads_kept = functional.backward(ctx, grad, fc1, fc2)
    storages = _forward_storages(monkeypatch)
    leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]
    run = lambda: mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], config=config)  # noqa: E731
    if hooks:
        y, saved = _saved_by_autograd(run)
        saved_storages = [t.untyped_storage() for t in saved]
        del saved
    else:
        y, saved_storages = run(), []
    y.backward(grad)
    (kept,) = storages
    freed = {name for name, storage in kept.items() if storage.nbytes() == 0}
    # BF16 at EP = 1 keeps act too; FP8 keeps gate/up only (design.md §12.4).
    assert freed == ({"route_table", "gate_up", "act"} if precision == "bf16" else {"route_table", "gate_up"})
    released = {kept[name]._cdata for name in freed}
    assert all(storage.nbytes() > 0 for storage in saved_storages if storage._cdata not in released)
    # The gradients are those of a backward that keeps them.
    for name, got, want in (("x", leaves[0].grad, grads_kept.x), ("topk_weights", leaves[1].grad, grads_kept.topk_weights),
                            ("fc1", leaves[2].grad, grads_kept.fc1), ("fc2", leaves[3].grad, grads_kept.fc2)):
        assert torch.equal(got, want), f"d{name} with the activations released vs kept"


def test_double_backward_keeps_them():
    """Under create_graph the reference's backward ops save gate/up and act for the next backward, so
    nothing is freed then, and a second-order backward runs (it read freed memory when they were)."""
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["tiny_model"], "uniform", torch.float32, seed=13)
    leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]
    y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    grad_y = grad.clone().requires_grad_()
    (d_fc2,) = torch.autograd.grad(y, leaves[3], grad_outputs=grad_y, create_graph=True)
    (d_fc2 * d_fc2).sum().backward()
    assert grad_y.grad is not None and torch.isfinite(grad_y.grad).all() and grad_y.grad.abs().sum() > 0


def test_a_released_context_serves_no_second_backward():
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["small"], "uniform", torch.float32, seed=6)
    _, ctx = functional.forward(x, ids, weights, fc1, fc2)
    first = functional.backward(ctx, grad, fc1, fc2, release_saved=True)
    assert ctx.route_table is None and ctx.gate_up is None and first.topk_weights is not None
    with pytest.raises(ValueError, match="ctx: its route_table was released"):
        functional.backward(ctx, grad, fc1, fc2)


def test_backward_twice_through_one_call_is_a_runtime_error_naming_retain_graph():
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["small"], "uniform", torch.float32, seed=7)
    leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]
    y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    y.backward(grad, retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.backward(grad)


def test_a_tensor_sharing_its_storage_is_dropped_not_freed():
    """A kept activation that is a view into a larger buffer (not what the exchanges and stages return,
    but what the contract cannot rule out for a backend) is only dropped from the context: the buffer
    stays whole."""
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["small"], "uniform", torch.float32, seed=8)
    _, ctx = functional.forward(x, ids, weights, fc1, fc2)
    buffers = {}
    for name in ("route_table", "gate_up"):
        tensor = getattr(ctx, name)
        buffers[name] = torch.cat((tensor, torch.randn(3, tensor.shape[1])))
        view = buffers[name][:tensor.shape[0]]
        setattr(ctx, name, view)
        ctx.made[name] = weakref.ref(view)  # (as if forward had made it: only the storage check refuses)
    functional.backward(ctx, grad, fc1, fc2, release_saved=True)
    for name, buffer in buffers.items():
        assert getattr(ctx, name) is None
        assert buffer.untyped_storage().nbytes() == buffer.numel() * buffer.element_size(), name


def test_a_hooks_own_tensors_are_never_freed():
    """A saved-tensor hook that keeps what it hands back (an offloading hook's reload buffers) gets them
    back whole: backward frees only the tensors forward made, and drops the hook's."""
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["tiny_model"], "uniform", torch.float32, seed=10)
    buffers = []

    def pack(t):
        buffers.append(t.clone())
        return len(buffers) - 1

    leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda i: buffers[i]):
        y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    y.backward(grad)
    assert buffers and all(b.untyped_storage().nbytes() == b.numel() * b.element_size() for b in buffers)
    want = functional.backward(functional.forward(x, ids, weights, fc1, fc2)[1], grad, fc1, fc2)
    assert torch.equal(leaves[2].grad, want.fc1) and torch.equal(leaves[1].grad, want.topk_weights)


def test_a_backward_that_failed_is_not_run_again(monkeypatch):
    """A backward that raises after freeing the route table leaves nothing a retry could read freed: the
    retry is the RuntimeError, not a read of released memory."""
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["small"], "uniform", torch.float32, seed=11)
    leaves = [t.clone().requires_grad_() for t in (x, weights, fc1, fc2)]
    y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3])

    def failing(*args, **kwargs):
        raise MemoryError("out of memory in backward (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(functional, "_backward_sources", failing)
        with pytest.raises(MemoryError):
            y.backward(grad)
    with pytest.raises(RuntimeError, match="again after a backward that failed"):
        y.backward(grad)


def test_a_context_with_a_freed_tensor_is_refused_before_anything_runs():
    """functional.backward on a context whose tensors were freed under it (a saved tensor released by
    another backward) is a ValueError naming the tensor, not a read of released memory."""
    x, ids, weights, fc1, fc2, grad = make_inputs(SHAPES["small"], "uniform", torch.float32, seed=12)
    _, ctx = functional.forward(x, ids, weights, fc1, fc2)
    ctx.gate_up.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="ctx: its gate_up was released"):
        functional.backward(ctx, grad, fc1, fc2)
