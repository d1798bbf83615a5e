"""The kernel backend on a Hopper GPU against the reference (skipped elsewhere; run on the device).

Tolerances (the schemes of tests/oracle.py):
- data movement (dispatch, combine, pull of dY rows): exact — same fp32 operations in the same order;
- SwiGLU: the kernel's expf may differ from torch's in the last fp32 bit, which can flip one bf16
  rounding: at most 1 bf16 ulp per element (scheme 4);
- route-weight gradients: an fp32 dot product over H in a different order (scheme 2);
- the whole layer in bf16: error against the fp32 reference at most 2x the error of the bf16
  PyTorch reference (the same-precision implementation), in the norm and per token (scheme 5).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_mok import MoKConfig, mok_moe
from megatron_mok.backends import reference
from megatron_mok.comm.exchange import GradSource, RowSource
from megatron_mok.schedule import build_schedule_from_gathered
from megatron_mok import ops
from cuda_checks import (
    NEEDS_HOPPER_KERNELS,
    assert_bitwise_reproducible_without_host_sync,
    assert_mok_moe_graph_replays_eager,
    poison_allocator,
)
from oracle import (
    Shape, assert_close_reordered_sum, assert_every_row_within_same_precision, assert_within_same_precision,
    assert_within_ulps,
)

pytestmark = NEEDS_HOPPER_KERNELS


SHAPES = {
    "minimal": Shape(1, 8, 8, 1, 1),
    "odd_tokens": Shape(37, 64, 24, 5, 3),
    "deepseek_v3_ep8_slice": Shape(512, 7168, 2048, 32, 8),
    "qwen3_235b_slice": Shape(512, 4096, 1536, 16, 8),
    "qwen3_30b": Shape(1024, 2048, 768, 128, 8),
}
ROUTINGS = ("uniform", "skewed", "empty_experts", "one_expert", "dropped")


def make_ids(kind: str, s: Shape, gen: torch.Generator) -> torch.Tensor:
    t, e, k = s.num_tokens, s.num_experts, s.topk
    if kind == "one_expert":
        return torch.full((t, k), e // 2, device="cuda", dtype=torch.int64)
    scores = torch.rand(t, e, device="cuda", generator=gen)
    if kind == "skewed":  # a few hot experts
        scores = scores + 3.0 * (torch.arange(e, device="cuda") < max(1, e // 8))
    if kind == "empty_experts":  # odd experts never chosen
        scores = scores - 10.0 * (torch.arange(e, device="cuda") % 2 == 1)
    ids = scores.topk(min(k, e), dim=1).indices
    if ids.shape[1] < k:
        ids = torch.cat([ids, ids[:, : k - ids.shape[1]]], dim=1)
    if kind == "empty_experts" and e > 1:
        ids = torch.where(ids % 2 == 1, -1, ids)
    if kind == "dropped":
        ids = torch.where(torch.rand(t, k, device="cuda", generator=gen) < 0.25, -1, ids)
    return ids


def make_inputs(s: Shape, routing: str, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(s.num_tokens, s.hidden, device="cuda", generator=gen).bfloat16()
    ids = make_ids(routing, s, gen)
    w = torch.rand(s.num_tokens, s.topk, device="cuda", generator=gen)
    fc1 = (torch.randn(s.num_experts, 2 * s.ffn, s.hidden, device="cuda", generator=gen) / s.hidden**0.5).bfloat16()
    fc2 = (torch.randn(s.num_experts, s.hidden, s.ffn, device="cuda", generator=gen) / s.ffn**0.5).bfloat16()
    grad = torch.randn(s.num_tokens, s.hidden, device="cuda", generator=gen).bfloat16()
    return x, ids, w, fc1, fc2, grad


def run(config: MoKConfig, x, ids, w, fc1, fc2, grad, dtype=None):
    leaves = [t.detach().clone() for t in (x, w, fc1, fc2)]
    if dtype is not None:
        leaves = [leaves[0].to(dtype), leaves[1], leaves[2].to(dtype), leaves[3].to(dtype)]
    leaves = [t.requires_grad_() for t in leaves]
    poison_allocator()
    y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], config=config)
    y.backward(grad.to(y.dtype))
    return y.detach(), [leaf.grad for leaf in leaves]


KERNEL = MoKConfig(backend="kernel")
REFERENCE = MoKConfig(backend="reference")
# The kernel backend with each forward expert GEMM (MoKConfig.expert_gemm); sm90_ring3: the sm90
# dispatch through a ring of 3 minibatches, which the shapes of more than 3072 rows wrap around.
KERNELS = {gemm: MoKConfig(backend="kernel", expert_gemm=gemm) for gemm in ("auto", "grouped_mm", "sm90")}
KERNELS["sm90_ring3"] = MoKConfig(backend="kernel", expert_gemm="sm90", dispatch_ring_minibatches=3)


@pytest.mark.parametrize("expert_gemm", list(KERNELS))
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_kernel_error_within_twice_the_bf16_reference(shape_name, routing, expert_gemm):
    s = SHAPES[shape_name]
    inputs = make_inputs(s, routing, seed=zlib.crc32(f"{shape_name}/{routing}".encode()) % 1000)
    y_k, g_k = run(KERNELS[expert_gemm], *inputs)
    y_b, g_b = run(REFERENCE, *inputs)
    y_f, g_f = run(REFERENCE, *inputs, dtype=torch.float32)
    names = ("y", "dx", "dweights", "dfc1", "dfc2")
    for name, got, same_precision, exact in zip(names, (y_k, *g_k), (y_b, *g_b), (y_f, *g_f)):
        assert torch.isfinite(got).all(), f"{name}: non-finite (unwritten) elements"
        assert_within_same_precision(got, same_precision, exact, msg=name)
        if name in ("y", "dx", "dweights"):
            assert_every_row_within_same_precision(got, same_precision, exact, msg=name)


def _schedule(s: Shape, routing: str, seed: int):
    x, ids, w, fc1, fc2, grad = make_inputs(s, routing, seed)
    schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=s.num_experts)
    return x, ids, w, grad, schedule


@pytest.mark.parametrize("routing", ROUTINGS)
def test_data_movement_ops_match_reference_exactly(routing):
    s = SHAPES["odd_tokens"]
    x, ids, w, grad, schedule = _schedule(s, routing, seed=3)
    poison_allocator()
    rows = ops.dispatch_rows(x, schedule.slot_to_route, s.topk)
    assert torch.equal(rows, reference.dispatch_rows(RowSource(x), schedule))

    table = torch.randn(schedule.capacity, s.hidden, device="cuda").bfloat16()
    index = _single_rank_exchange().route_index(schedule, ids)
    read = torch.zeros(schedule.capacity, dtype=torch.bool, device="cuda")
    read[index[index >= 0]] = True  # the table rows some route reads
    for weights in (w, None):
        got = ops.combine(table, index, weights, s.topk)
        want = reference.combine(table, index, weights, s.topk, torch.bfloat16)
        assert torch.equal(got, want)
        # The kept copy: the same y, every row a route reads copied, the others not written (NaN stays).
        keep = torch.full((schedule.capacity + 3, s.hidden), float("nan"), device="cuda").bfloat16()
        assert torch.equal(ops.combine_keeping(table, index, weights, s.topk, keep), want)
        assert torch.equal(keep[: schedule.capacity][read], table[read])
        assert keep[: schedule.capacity][~read].isnan().all() and keep[schedule.capacity:].isnan().all()

    pulled = ops.pull_grad_rows(grad, w.reshape(-1), schedule.slot_to_route, s.topk)
    assert torch.equal(pulled, reference.pull_route_grads(GradSource(RowSource(grad), RowSource(w.reshape(-1))), schedule))

    d_w = ops.route_weight_grads(grad, table, index, s.topk)
    want = reference.route_weight_grads(grad, table, index, s.topk)
    # The same H products in fp32 in another order (scheme 2), both rounded to nearest (CUDA cores).
    rows = reference.gather_route_rows(table, index, s.topk)  # (T, K, H)
    abs_sum = torch.einsum("th,tkh->tk", grad.double().abs(), rows.double().abs())
    assert_close_reordered_sum(d_w, want, abs_sum, s.hidden, msg="route weight grads (fp32 dot, other order)")


def test_row_gather_pulls_any_slot_table():
    """The token-major dispatch writes each route's row once and fills the rest: padding rows (-1)
    and, for a slot table that repeats a route (never one from the schedule), every repeat."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    num_tokens, topk, hidden = 37, 3, 64
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    w = torch.rand(num_tokens * topk, device="cuda", generator=gen)
    routes = torch.randint(0, num_tokens * topk, (90,), device="cuda", generator=gen)
    routes[::7] = -1
    routes[5] = routes[4]  # a repeated route
    poison_allocator()
    rows = ops.dispatch_rows(x, routes, topk)
    token = routes.clamp(min=0) // topk
    want = torch.where((routes >= 0)[:, None], x[token], torch.zeros_like(x[token]))
    assert torch.equal(rows, want)
    pulled = ops.pull_grad_rows(x, w, routes, topk)
    scaled = (x[token].float() * w[routes.clamp(min=0)][:, None]).bfloat16()
    assert torch.equal(pulled, torch.where((routes >= 0)[:, None], scaled, torch.zeros_like(scaled)))


SCHEDULE_CASES = [
    # (num_ranks, num_tokens, topk, num_local_experts, alignment, routing)
    (1, 37, 3, 5, 1, "dropped"),
    (1, 4096, 8, 32, 1, "skewed"),
    (1, 4096, 8, 128, 128, "uniform"),
    (8, 1024, 8, 32, 1, "uniform"),
    (8, 1024, 8, 48, 64, "one_expert"),
    (4, 333, 6, 384, 1, "dropped"),
    (2, 1000, 4, 3, 8, "all_dropped"),
    # Many schedule blocks (4096 routes each, at most 256, then longer): 32, 79 and 256 blocks.
    (1, 16384, 8, 128, 1, "uniform"),
    (1, 40000, 8, 64, 128, "skewed"),
    (8, 20000, 8, 32, 1, "dropped"),
]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_ranks,num_tokens,topk,num_local,align,routing", SCHEDULE_CASES)
def test_schedule_kernel_matches_reference_exactly(num_ranks, num_tokens, topk, num_local, align, routing, id_dtype):
    from megatron_mok.schedule import build_schedule_torch

    gen = torch.Generator(device="cuda").manual_seed(num_tokens + num_local)
    num_experts = num_ranks * num_local
    ids = torch.randint(0, num_experts, (num_ranks, num_tokens, topk), device="cuda", generator=gen)
    if routing == "dropped":
        ids = torch.where(torch.rand(ids.shape, device="cuda", generator=gen) < 0.3, -1, ids)
    elif routing == "skewed":
        ids = torch.where(torch.rand(ids.shape, device="cuda", generator=gen) < 0.5, 0, ids)
    elif routing == "one_expert":
        ids.fill_(num_experts - 1)
    elif routing == "all_dropped":
        ids.fill_(-1)
    ids = ids.to(id_dtype)
    for rank in sorted({0, num_ranks - 1}):
        got = build_schedule_from_gathered(ids, rank=rank, num_local_experts=num_local, segment_alignment=align)
        want = build_schedule_torch(ids, rank=rank, num_local_experts=num_local, segment_alignment=align)
        for field in ("slot_to_route", "route_to_slot", "expert_counts", "expert_offsets"):
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: {field} differs"


def _single_rank_exchange():
    from megatron_mok.comm import exchange_for, get_expert_parallel_group

    return exchange_for(get_expert_parallel_group(None, torch.device("cuda")))


def test_swiglu_ops_match_reference_within_one_bf16_ulp():
    s = SHAPES["qwen3_30b"]
    gate_up = torch.randn(300, 2 * s.ffn, device="cuda").bfloat16()
    grad_act = torch.randn(300, s.ffn, device="cuda").bfloat16()
    offsets = torch.tensor([0, 100, 250], device="cuda", dtype=torch.int32)  # rows 250.. unused
    poison_allocator()
    act = ops.swiglu_forward(gate_up, offsets)
    grad = ops.swiglu_backward(gate_up, grad_act, offsets)
    assert torch.equal(act[250:], torch.zeros_like(act[250:]))
    assert torch.equal(grad[250:], torch.zeros_like(grad[250:]))
    assert_within_ulps(act[:250], reference.swiglu(gate_up[:250]), 1, msg="swiglu")
    assert_within_ulps(grad[:250], reference.swiglu_backward(gate_up[:250], grad_act[:250]), 1, msg="swiglu backward")


@pytest.mark.parametrize("op_name", ["build_schedule", "dispatch_rows", "combine", "combine_keeping", "pull_grad_rows",
                                     "route_weight_grads", "swiglu_forward", "swiglu_backward"])
def test_op_registration(op_name):
    """Schema, fake (meta) implementation and torch.compile support of each custom op."""
    s = SHAPES["odd_tokens"]
    x, ids, w, grad, schedule = _schedule(s, "dropped", seed=5)
    table = torch.randn(schedule.capacity, s.hidden, device="cuda").bfloat16()
    index = _single_rank_exchange().route_index(schedule, ids)
    gate_up = torch.randn(schedule.capacity, 2 * s.ffn, device="cuda").bfloat16()
    args = {
        "build_schedule": (ids.unsqueeze(0), 0, s.num_experts, 4, s.num_experts),
        "dispatch_rows": (x, schedule.slot_to_route, s.topk),
        "combine": (table, index, w, s.topk),
        "combine_keeping": (table, index, w, s.topk, torch.empty_like(table)),
        "pull_grad_rows": (grad, w.reshape(-1), schedule.slot_to_route, s.topk),
        "route_weight_grads": (grad, table, index, s.topk),
        "swiglu_forward": (gate_up, schedule.expert_offsets),
        "swiglu_backward": (gate_up, gate_up[:, : s.ffn].contiguous(), schedule.expert_offsets),
    }[op_name]
    op = getattr(torch.ops.megatron_mok, op_name).default
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)
    got, want = compiled(*args), op(*args)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("expert_gemm", list(KERNELS))
def test_kernel_backend_bitwise_deterministic_without_host_sync(expert_gemm):
    inputs = make_inputs(SHAPES["qwen3_30b"], "skewed", seed=11)
    assert_bitwise_reproducible_without_host_sync(lambda: run(KERNELS[expert_gemm], *inputs))


@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
def test_ring_dispatch_gives_the_unbounded_results_bit_for_bit(routing):
    """The ring only bounds where the dispatched rows live; forward reads the same rows and backward
    gathers them again for the fc1 weight gradient, so y and every gradient equal the unbounded run."""
    s = Shape(2048, 256, 128, 16, 4)  # 8192 rows: 8 minibatches, the ring of 3 wraps twice
    inputs = make_inputs(s, routing, seed=21)
    y_ring, g_ring = run(KERNELS["sm90_ring3"], *inputs)
    y_all, g_all = run(MoKConfig(backend="kernel", expert_gemm="sm90", dispatch_ring_minibatches=0), *inputs)
    assert torch.equal(y_ring, y_all)
    for name, a, b in zip(("dx", "dweights", "dfc1", "dfc2"), g_ring, g_all):
        assert torch.equal(a, b), name


def _forward_memory(config: MoKConfig, inputs) -> tuple[int, int]:
    """(bytes held after a forward under autograd, peak bytes of forward + backward), above the inputs."""
    x, ids, w, fc1, fc2, grad = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, fc1, fc2)]
    mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], config=config)  # warm-up: one-time allocations
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = mok_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], config=config)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    y.backward(grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del y
    return held, peak


@pytest.mark.parametrize("expert_gemm", ["auto", "sm90_ring3"])
def test_memory_does_not_depend_on_the_routing(expert_gemm):
    """Every buffer's size follows from (tokens, topk, experts, hidden, ffn), never from the routing:
    all tokens to one expert needs exactly the memory of a uniform routing."""
    s = Shape(2048, 256, 128, 16, 4)
    uniform = _forward_memory(KERNELS[expert_gemm], make_inputs(s, "uniform", seed=23))
    for routing in ("one_expert", "skewed", "dropped"):
        assert _forward_memory(KERNELS[expert_gemm], make_inputs(s, routing, seed=23)) == uniform, routing


def test_ring_dispatch_does_not_keep_the_dispatched_rows():
    """Through the ring, forward keeps no (capacity, hidden) rows for backward: it holds at least
    their size less than the unbounded sm90 path (backward gathers them again)."""
    s = Shape(4096, 512, 128, 16, 4)  # 16384 rows of 1 KB: 16 MB, against a ring of 3 x 1024 rows
    inputs = make_inputs(s, "one_expert", seed=24)
    held_ring, _ = _forward_memory(KERNELS["sm90_ring3"], inputs)
    held_all, _ = _forward_memory(MoKConfig(backend="kernel", expert_gemm="sm90", dispatch_ring_minibatches=0), inputs)
    rows_bytes = s.num_tokens * s.topk * s.hidden * 2
    assert held_all - held_ring >= rows_bytes, (held_all, held_ring, rows_bytes)


def test_ring_dispatch_cuda_graph_replay():
    inputs = make_inputs(Shape(1100, 64, 32, 6, 4), "skewed", seed=22)  # 4400 rows > 3 minibatches
    assert_mok_moe_graph_replays_eager(KERNELS["sm90_ring3"], *inputs)


@pytest.mark.parametrize("expert_gemm", list(KERNELS))
def test_kernel_backend_cuda_graph_replay(expert_gemm):
    assert_mok_moe_graph_replays_eager(KERNELS[expert_gemm], *make_inputs(SHAPES["odd_tokens"], "dropped", seed=12))


_BAD_EXPERT_ID = r"""
import sys
import torch
from megatron_mok import MoKConfig, mok_moe, ops
torch.manual_seed(0)
x = torch.randn(300, 64, device="cuda").bfloat16()
ids = torch.randint(0, 4, (300, 2), device="cuda")
ids[217, 1] = int(sys.argv[1])
w = torch.rand(300, 2, device="cuda")
fc1 = torch.randn(4, 64, 64, device="cuda").bfloat16()
fc2 = torch.randn(4, 64, 32, device="cuda").bfloat16()
try:
    if sys.argv[2] == "mok_moe":
        mok_moe(x, ids, w, fc1, fc2, config=MoKConfig(backend="kernel"))
    else:  # a schedule built without the check, passed in: forward checks the ids itself
        from megatron_mok import functional
        from megatron_mok.schedule import build_schedule_from_gathered
        schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=4)
        functional.forward(x, ids, w, fc1, fc2, config=MoKConfig(backend="kernel"), schedule=schedule)
    torch.cuda.synchronize()
    print("no error")
except RuntimeError as error:
    print("cuda error:", str(error).splitlines()[0])
print("record:", ops.last_failure())
"""


@pytest.mark.parametrize("bad_id", [4, -2, 1 << 40])
def test_bad_expert_id_on_cuda_traps_in_the_schedule_kernel_and_is_named(bad_id):
    """On CUDA the ids are checked inside the schedule kernel (no host sync): a bad one stops the
    process's CUDA work with an error, and the failure record names the check."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", _BAD_EXPERT_ID, str(bad_id), "mok_moe"], capture_output=True,
                            text=True, timeout=300, env=env)
    out = result.stdout + result.stderr
    assert "cuda error:" in result.stdout and "no error" not in result.stdout, out
    assert "schedule kernel: topk_ids holds an expert id outside [-1, num_experts)" in result.stdout, out


@pytest.mark.parametrize("bad_id", [4, -5])
def test_bad_expert_id_with_an_unchecked_schedule_passed_in_is_still_an_error(bad_id):
    """A schedule built without the id check and passed to functional.forward: forward checks the
    ids itself (a device-side assert), so a bad id is never a silently dropped route."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", _BAD_EXPERT_ID, str(bad_id), "schedule"], capture_output=True,
                            text=True, timeout=300, env=env)
    out = result.stdout + result.stderr
    assert "cuda error:" in result.stdout and "no error" not in result.stdout, out
    # torch._assert_async: the device prints the message; the host sees a device-side assert.
    assert "topk_ids holds an expert id outside" in out or "device-side assert" in result.stdout, out


BAD_FOR_KERNEL = [
    ("fp32", dict(dtype=torch.float32), "bfloat16 only"),
    ("hidden not multiple of 8", dict(hidden=12), "multiples of 8"),
    ("ffn not multiple of 8", dict(ffn=12), "multiples of 8"),
]


@pytest.mark.parametrize("case,change,fragment", BAD_FOR_KERNEL, ids=[c[0] for c in BAD_FOR_KERNEL])
def test_unsupported_call_is_an_error_with_kernel_and_a_warned_reference_with_auto(case, change, fragment):
    hidden, ffn = change.get("hidden", 16), change.get("ffn", 16)
    dtype = change.get("dtype", torch.bfloat16)
    x = torch.randn(5, hidden, device="cuda", dtype=dtype)
    ids = torch.randint(0, 2, (5, 2), device="cuda")
    w = torch.rand(5, 2, device="cuda")
    fc1 = torch.randn(2, 2 * ffn, hidden, device="cuda", dtype=dtype)
    fc2 = torch.randn(2, hidden, ffn, device="cuda", dtype=dtype)
    with pytest.raises(ValueError, match=fragment):
        mok_moe(x, ids, w, fc1, fc2, config=KERNEL)
    from megatron_mok import backends

    backends._warned.clear()
    with pytest.warns(UserWarning, match=fragment):
        y = mok_moe(x, ids, w, fc1, fc2, config=MoKConfig(backend="auto"))
    want = mok_moe(x, ids, w, fc1, fc2, config=REFERENCE)
    assert torch.equal(y, want)


@pytest.mark.parametrize("expert_gemm", list(KERNELS))
def test_kernel_backend_under_torch_compile_fullgraph(expert_gemm):
    x, ids, w, fc1, fc2, grad = make_inputs(SHAPES["odd_tokens"], "dropped", seed=13)
    config = KERNELS[expert_gemm]
    compiled = torch.compile(lambda *a: mok_moe(*a, config=config), fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, fc1, fc2)]
    y = compiled(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    y.backward(grad)
    eager_y, eager_grads = run(config, x, ids, w, fc1, fc2, grad)
    assert torch.equal(y, eager_y)
    for leaf, want in zip(leaves, eager_grads):
        assert torch.equal(leaf.grad, want)
