"""The persistent sm90 expert GEMM (csrc/expert_gemm_sm90.cuh) against fp32 (skipped without a
Hopper GPU and the built extension; run on the device).

Tolerance, per element (tests/oracle.py's scheme 2): the kernel accumulates the bf16 products in fp32
(in its own order) and rounds once to bf16. Against the fp32 product of the same bf16 inputs that is
at most one bf16 rounding, 2^-8 |ref|, plus the fp32 accumulation error of a K-term sum in a different
order, bounded by its worst case K * 2^-23 * (|a| @ |w|^T) (tensor cores: rounding not known to be to
nearest). act must equal swiglu_forward_kernel(gate_up) bit for bit: the epilogue applies the same
formula to the same rounded values.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_mok import limits, ops
from megatron_mok.backends.tuning import EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M
from cuda_checks import NEEDS_HOPPER_KERNELS, poison_allocator
from oracle import reordered_sum_bound

# The launch shape (cluster_m, group_m) the kernel backend runs, for the tests of other properties.
LAUNCH = (EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M)

pytestmark = NEEDS_HOPPER_KERNELS

# name: (segment rows per expert, K, N). N is the weight's rows (the SwiGLU cases use 2F).
CASES = {
    "one_row": ([1], 8, 16),
    "exact_tiles": ([128, 256], 128, 512),
    "tails_everywhere": ([37, 0, 129, 5], 72, 208),
    "empty_experts": ([0, 0, 300, 0], 64, 256),
    "all_rows_one_expert": ([0, 1000, 0], 192, 272),
    "many_small_experts": ([3, 17, 0, 64, 65, 127, 128, 1, 0, 250] * 4, 64, 144),
    "deepseek_v3_gate_up": ([700, 300, 0, 1100], 7168, 4096),
    "deepseek_v3_down": ([700, 300, 0, 1100], 2048, 7168),
    "qwen3_30b_gate_up": ([40, 0, 300, 7] * 8, 2048, 1536),
}


def make_case(rows_per_expert, k, n, seed, tail_rows=5):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.tensor(rows_per_expert, dtype=torch.int32)
    offsets = torch.zeros(len(rows_per_expert) + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    num_rows = int(offsets[-1]) + tail_rows  # rows past the last segment: never written
    a = torch.randn(num_rows, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(len(rows_per_expert), n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    return a, w, offsets.cuda(), offsets.tolist()


def fp32_reference_and_bound(a, w, offsets_host):
    """Per-segment fp32 products of the bf16 inputs and the elementwise error bound (module doc)."""
    k = a.shape[1]
    ref = torch.zeros(offsets_host[-1], w.shape[1], device="cuda")
    bound = torch.zeros_like(ref)
    for e in range(w.shape[0]):
        lo, hi = offsets_host[e], offsets_host[e + 1]
        if hi > lo:
            ref[lo:hi] = a[lo:hi].float() @ w[e].float().T
            abs_sum = a[lo:hi].float().abs() @ w[e].float().abs().T
            bound[lo:hi] = tensor_core_bound(abs_sum, k, ref[lo:hi])
    return ref, bound


def tensor_core_bound(abs_sum, num_terms, ref):
    """The module doc's bound: a worst-case reordered fp32 sum, rounded once to bf16 (scheme 2)."""
    return reordered_sum_bound(abs_sum, num_terms, round_to_nearest=False, out_dtype=torch.bfloat16, want=ref)


def assert_within(got, ref, bound, what):
    assert torch.isfinite(got).all(), f"{what}: non-finite (unwritten) elements"
    excess = (got.float() - ref).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, f"{what}: element {divmod(worst, ref.shape[1])} off by {excess.max():.3e} past its bound"


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_expert_gemm_store_matches_fp32(case, cluster_m):
    rows, k, n = CASES[case]
    a, w, offsets, offsets_host = make_case(rows, k, n, seed=zlib.crc32(case.encode()) % 1000)
    poison_allocator()
    out = ops.expert_gemm(a, w, offsets, cluster_m, EXPERT_GEMM_GROUP_M)
    assert out.shape == (a.shape[0], n) and out.dtype == torch.bfloat16
    ref, bound = fp32_reference_and_bound(a, w, offsets_host)
    assert_within(out[: offsets_host[-1]], ref, bound, "out")


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_expert_gemm_swiglu_matches_fp32_and_the_swiglu_kernel(case, cluster_m):
    rows, k, two_ffn = CASES[case]
    if two_ffn % 16:
        pytest.skip("SwiGLU needs gate and up halves that are multiples of 8")
    a, w, offsets, offsets_host = make_case(rows, k, two_ffn, seed=zlib.crc32(case.encode()) % 1000 + 1)
    poison_allocator()
    gate_up, act = ops.expert_gemm_swiglu(a, w, offsets, cluster_m, EXPERT_GEMM_GROUP_M)
    end = offsets_host[-1]
    ref, bound = fp32_reference_and_bound(a, w, offsets_host)
    assert_within(gate_up[:end], ref, bound, "gate_up")
    assert torch.isfinite(act[:end]).all(), "act: non-finite (unwritten) elements"
    assert torch.equal(act[:end], ops.swiglu_forward(gate_up, offsets)[:end])


def test_expert_gemm_is_bitwise_deterministic():
    a, w, offsets, offsets_host = make_case([300, 0, 900, 77], 1024, 768, seed=3)
    end = offsets_host[-1]  # rows past it are never written
    first = ops.expert_gemm(a, w, offsets, *LAUNCH)[:end]
    first_gu, first_act = (t[:end] for t in ops.expert_gemm_swiglu(a, w, offsets, *LAUNCH))
    for _ in range(2):
        assert torch.equal(ops.expert_gemm(a, w, offsets, *LAUNCH)[:end], first)
        gu, act = ops.expert_gemm_swiglu(a, w, offsets, *LAUNCH)
        assert torch.equal(gu[:end], first_gu) and torch.equal(act[:end], first_act)


def test_expert_gemm_on_schedule_offsets_with_padding():
    """Segments padded by the schedule (segment_alignment 8): padding rows are zero rows of A and
    produce zero rows; every row of a segment is written."""
    from megatron_mok.schedule import build_schedule_from_gathered

    gen = torch.Generator(device="cuda").manual_seed(9)
    ids = torch.randint(0, 6, (333, 4), device="cuda", generator=gen)
    schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=6, segment_alignment=8)
    x = torch.randn(333, 256, device="cuda", generator=gen).bfloat16()
    rows = ops.dispatch_rows(x, schedule.slot_to_route, 4)
    w = (torch.randn(6, 320, 256, device="cuda", generator=gen) / 16).bfloat16()
    offsets_host = schedule.expert_offsets.tolist()
    poison_allocator()
    gate_up, act = ops.expert_gemm_swiglu(rows, w, schedule.expert_offsets, *LAUNCH)
    ref, bound = fp32_reference_and_bound(rows, w, offsets_host)
    end = offsets_host[-1]
    assert_within(gate_up[:end], ref, bound, "gate_up")
    padding = schedule.slot_to_route[:end] < 0
    assert padding.any() and torch.equal(act[:end][padding], torch.zeros_like(act[:end][padding]))


def test_expert_gemm_with_no_rows_anywhere():
    a, w, offsets, _ = make_case([0, 0, 0], 64, 128, seed=4, tail_rows=3)
    out = ops.expert_gemm(a, w, offsets, *LAUNCH)  # nothing to compute: no tile, no hang
    torch.cuda.synchronize()
    assert out.shape == (3, 128)
    empty = ops.expert_gemm(a[:0], w, offsets, *LAUNCH)
    assert empty.shape == (0, 128)


BAD = [
    ("a fp32", lambda a, w, o: (a.float(), w, o), "bfloat16"),
    ("K not a multiple of 8", lambda a, w, o: (a[:, :60].contiguous(), w[:, :, :60].contiguous(), o), "multiple of 8"),
    ("K mismatch", lambda a, w, o: (a, w[:, :, :56].contiguous(), o), "same K"),
    ("offsets int64", lambda a, w, o: (a, w, o.long()), "expert_offsets must be int32"),
    ("offsets wrong length", lambda a, w, o: (a, w, o[:-1]), "expert_offsets must be int32"),
    ("weight not contiguous", lambda a, w, o: (a, w.transpose(1, 2), o), "weight must be a contiguous"),
    ("a on the CPU", lambda a, w, o: (a.cpu(), w, o), "a must be a .*CUDA"),
    ("no experts", lambda a, w, o: (a, w[:0], o[:1]), "at least one expert"),
    ("cluster of 4", lambda a, w, o: (a, w, o, 4), "cluster_m must be 1 or 2"),
    ("raster group 3 with clusters of 2", lambda a, w, o: (a, w, o, 2, 3), "group_m must be a multiple of cluster_m"),
    ("raster group 0", lambda a, w, o: (a, w, o, 1, 0), "group_m must be"),
]


@pytest.mark.parametrize("case,change,fragment", BAD, ids=[b[0] for b in BAD])
def test_expert_gemm_bad_input_is_a_clear_error(case, change, fragment):
    a, w, offsets, _ = make_case([10, 20], 64, 64, seed=5)
    args = change(a, w, offsets)
    with pytest.raises(RuntimeError, match=fragment):
        ops.expert_gemm(*args, *LAUNCH[len(args) - 3:])  # (the launch shape a case leaves out: LAUNCH's)


def test_expert_gemm_ops_registration():
    a, w, offsets, _ = make_case([10, 0, 20], 64, 64, seed=6)
    slot_to_route = torch.arange(a.shape[0], device="cuda", dtype=torch.int64)  # topk 1: row r is a[r]
    calls = (
        (torch.ops.megatron_mok.expert_gemm.default, (a, w, offsets, 2, 4)),
        (torch.ops.megatron_mok.expert_gemm_swiglu.default, (a, w, offsets, 2, 4)),
        (torch.ops.megatron_mok.dispatch_expert_gemm_swiglu.default, (a, slot_to_route, 1, w, offsets, 2, 4, 0)),
    )
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        compiled = torch.compile(lambda *args, op=op: op(*args), fullgraph=True)
        got, want = compiled(*args), op(*args)
        for x, y in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(x[:30], y[:30])
    assert ops.last_failure() is None


# The dispatching GEMM (dispatch warps hand minibatches of rows to the GEMM through ready counters)
# must write the dispatch kernel's rows and the GEMM of those rows, bit for bit: the same bf16 rows
# reach the same wgmma sequence. Rows at or past offsets[-1] are not written.
# name: (tokens, topk, experts, K, 2F, routing, segment alignment)
DISPATCH_CASES = {
    "uniform": (300, 4, 6, 256, 320, "uniform", 8),
    "odd_tokens_k_tail": (77, 3, 5, 200, 144, "uniform", 1),
    "skewed": (512, 8, 8, 128, 256, "skewed", 16),
    "all_to_one_expert": (400, 2, 4, 64, 528, "one", 8),
    "dropped_routes": (257, 4, 6, 192, 160, "dropped", 8),
    "empty_experts": (200, 2, 9, 128, 256, "even_experts_only", 1),
    "many_minibatches": (1500, 8, 16, 64, 256, "uniform", 8),
    "deepseek_v3_like": (1024, 8, 32, 7168, 1024, "uniform", 16),
}


def dispatch_case(tokens, topk, experts, k, two_ffn, routing, alignment, seed):
    from megatron_mok.schedule import build_schedule_from_gathered

    gen = torch.Generator(device="cuda").manual_seed(seed)
    if routing == "skewed":  # expert e drawn with probability ~ 2^-e
        probs = torch.tensor([2.0**-e for e in range(experts)], device="cuda")
        ids = torch.multinomial(probs.expand(tokens, -1), topk, generator=gen)
    elif routing == "one":
        ids = torch.full((tokens, topk), experts - 1, device="cuda")
    else:
        ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1).indices
        if routing == "dropped":
            ids[torch.rand(tokens, topk, device="cuda", generator=gen) < 0.3] = -1
        if routing == "even_experts_only":
            ids = (ids // 2) * 2
    schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=experts, segment_alignment=alignment)
    x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(experts, two_ffn, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    return schedule, x, w


@pytest.mark.parametrize("cluster_m,group_m", [(1, 16), (2, 16), (1, 1), (2, 6)])
@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_dispatching_gemm_equals_dispatch_then_gemm(case, cluster_m, group_m):
    schedule, x, w = dispatch_case(*DISPATCH_CASES[case], seed=zlib.crc32(case.encode()))
    topk = schedule.topk
    end = int(schedule.expert_offsets[-1])
    want_rows = ops.dispatch_rows(x, schedule.slot_to_route, topk)
    want_gate_up, want_act = ops.expert_gemm_swiglu(want_rows, w, schedule.expert_offsets, cluster_m, group_m)
    poison_allocator()
    rows, gate_up, act = ops.dispatch_expert_gemm_swiglu(
        x, schedule.slot_to_route, topk, w, schedule.expert_offsets, cluster_m, group_m
    )
    assert rows.shape == want_rows.shape and gate_up.shape == want_gate_up.shape and act.shape == want_act.shape
    assert torch.equal(rows[:end], want_rows[:end])
    assert torch.equal(gate_up[:end], want_gate_up[:end]) and torch.equal(act[:end], want_act[:end])
    # And against fp32 directly, so a mistake shared by both paths cannot pass.
    ref, bound = fp32_reference_and_bound(want_rows, w, schedule.expert_offsets.tolist())
    assert_within(gate_up[:end], ref, bound, "gate_up")
    again = ops.dispatch_expert_gemm_swiglu(x, schedule.slot_to_route, topk, w, schedule.expert_offsets, cluster_m, group_m)
    for first, second in zip((rows, gate_up, act), again):
        assert torch.equal(first[:end], second[:end])
    assert ops.last_failure() is None


# The ring buffer (ring_minibatches > 0): rows go to ring slots that are refilled once every tile has
# loaded them, so the buffer is bounded whatever the routing. The GEMM reads the same bf16 rows in
# the same order, so gate_up and act must equal the unbounded kernel's (dispatch then GEMM) bit for
# bit. Alignment 1 puts tiles across minibatch ends and across the ring's end (the mirrored rows).
# name: DISPATCH_CASES fields; every case has more minibatches than the rings below.
RING_CASES = {
    "uniform": (3000, 8, 16, 128, 256, "uniform", 1),
    "all_to_one_expert": (2500, 4, 4, 64, 160, "one", 1),
    "skewed": (2048, 8, 8, 192, 256, "skewed", 1),
    "dropped_routes": (2100, 6, 8, 64, 144, "dropped", 8),
    "empty_experts": (1800, 4, 9, 128, 128, "even_experts_only", 1),
}


@pytest.mark.parametrize("cluster_m,group_m,ring", [(1, 16, 3), (2, 16, 3), (1, 1, 2), (2, 6, 2), (1, 16, 5)])
@pytest.mark.parametrize("case", list(RING_CASES))
def test_dispatching_gemm_through_a_ring_equals_dispatch_then_gemm(case, cluster_m, group_m, ring):
    schedule, x, w = dispatch_case(*RING_CASES[case], seed=zlib.crc32(case.encode()) + ring)
    topk, capacity = schedule.topk, schedule.capacity
    assert capacity > ring * limits.DISPATCH_MINIBATCH_ROWS, "the case must wrap around the ring"
    end = int(schedule.expert_offsets[-1])
    want_rows = ops.dispatch_rows(x, schedule.slot_to_route, topk)
    want_gate_up, want_act = ops.expert_gemm_swiglu(want_rows, w, schedule.expert_offsets, cluster_m, group_m)
    poison_allocator()
    ring_rows, gate_up, act = ops.dispatch_expert_gemm_swiglu(
        x, schedule.slot_to_route, topk, w, schedule.expert_offsets, cluster_m, group_m, ring
    )
    assert ring_rows.shape == (limits.dispatch_ring_buffer_rows(capacity, ring), x.shape[1])
    assert ring_rows.shape[0] == ring * limits.DISPATCH_MINIBATCH_ROWS + 128 < capacity
    assert torch.equal(gate_up[:end], want_gate_up[:end]) and torch.equal(act[:end], want_act[:end])
    # The ring holds the last minibatches' rows at their positions (row r at r % ring rows).
    ring_len = ring * limits.DISPATCH_MINIBATCH_ROWS
    last = (end - 1) // limits.DISPATCH_MINIBATCH_ROWS
    for m in range(max(0, last - ring + 1), last + 1):
        lo, hi = m * limits.DISPATCH_MINIBATCH_ROWS, min(end, (m + 1) * limits.DISPATCH_MINIBATCH_ROWS)
        assert torch.equal(ring_rows[lo % ring_len : lo % ring_len + hi - lo], want_rows[lo:hi]), f"minibatch {m}"
    again = ops.dispatch_expert_gemm_swiglu(x, schedule.slot_to_route, topk, w, schedule.expert_offsets, cluster_m, group_m, ring)
    assert torch.equal(gate_up[:end], again[1][:end]) and torch.equal(act[:end], again[2][:end])
    assert ops.last_failure() is None


# (case, seed, ring_minibatches): the unbounded kernel, and through a ring of 3 minibatches.
HOLDS_SMS_CASES = [(DISPATCH_CASES["many_minibatches"], 13, 0), (RING_CASES["uniform"], 14, 3)]


@pytest.mark.parametrize("case,seed,ring", HOLDS_SMS_CASES, ids=["no_ring", "ring3"])
def test_dispatching_gemm_beside_a_kernel_that_holds_sms(case, seed, ring):
    """The dispatch chunks are claimed, not assigned, so the kernel must finish (and be right) when
    another stream's kernel holds SMs and not all of its CTAs can start at once. With the ring a
    dispatcher also waits for tiles of old minibatches: CTAs that start late must still get to them."""
    schedule, x, w = dispatch_case(*case, seed=seed)
    end = int(schedule.expert_offsets[-1])
    want_rows = ops.dispatch_rows(x, schedule.slot_to_route, schedule.topk)
    want = ops.expert_gemm_swiglu(want_rows, w, schedule.expert_offsets, *LAUNCH)
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    other = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(other):
        for _ in range(4):
            big @ big
    got = ops.dispatch_expert_gemm_swiglu(
        x, schedule.slot_to_route, schedule.topk, w, schedule.expert_offsets, *LAUNCH, ring_minibatches=ring
    )
    torch.cuda.synchronize()
    if ring == 0:  # (with a ring the first result is the ring, not the rows)
        assert torch.equal(got[0][:end], want_rows[:end])
    assert torch.equal(got[1][:end], want[0][:end]) and torch.equal(got[2][:end], want[1][:end])
    assert ops.last_failure() is None


@pytest.mark.parametrize("group_m,ring", [(16, 2), (16, 1), (24, 3), (1, -1)])
def test_dispatch_ring_too_short_for_the_raster_is_a_clear_error(group_m, ring):
    schedule, x, w = dispatch_case(*DISPATCH_CASES["uniform"], seed=15)
    with pytest.raises(RuntimeError, match="ring_minibatches must be 0"):
        ops.dispatch_expert_gemm_swiglu(x, schedule.slot_to_route, 4, w, schedule.expert_offsets, 1, group_m, ring)


def test_dispatch_ring_op_registration():
    """The fake's ring shape matches the op's, under opcheck and torch.compile(fullgraph=True)."""
    schedule, x, w = dispatch_case(*RING_CASES["all_to_one_expert"], seed=16)
    args = (x, schedule.slot_to_route, schedule.topk, w, schedule.expert_offsets, 1, 16, 3)
    op = torch.ops.megatron_mok.dispatch_expert_gemm_swiglu.default
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)
    end = int(schedule.expert_offsets[-1])
    got, want = compiled(*args), op(*args)
    assert got[0].shape == want[0].shape
    assert torch.equal(got[1][:end], want[1][:end]) and torch.equal(got[2][:end], want[2][:end])


@pytest.mark.parametrize("group_m", [1, 2, 5, 16, 64])
def test_raster_group_does_not_change_the_result(group_m):
    """The raster only reorders tiles; every tile's arithmetic is the same, so outputs are equal."""
    a, w, offsets, offsets_host = make_case(CASES["many_small_experts"][0], 64, 144, seed=11)
    end = offsets_host[-1]
    want = ops.expert_gemm(a, w, offsets, 1, 16)[:end]
    assert torch.equal(ops.expert_gemm(a, w, offsets, 1, group_m)[:end], want)


DISPATCH_BAD = [
    ("slot_to_route int32", lambda x, s, w, o: (x, s.int(), 4, w, o), "slot_to_route must be a contiguous int64"),
    ("slot_to_route 2-D", lambda x, s, w, o: (x, s.view(-1, 1), 4, w, o), "slot_to_route must be a contiguous int64"),
    ("topk 0", lambda x, s, w, o: (x, s, 0, w, o), "topk must be positive"),
    ("x fp32", lambda x, s, w, o: (x.float(), s, 4, w, o), "x and weight must be bfloat16"),
    ("x on the CPU", lambda x, s, w, o: (x.cpu(), s, 4, w, o), "x must be a CUDA"),
    ("odd gate/up rows", lambda x, s, w, o: (x, s, 4, w[:, :72].contiguous(), o), "gate and up rows"),
]


@pytest.mark.parametrize("case,change,fragment", DISPATCH_BAD, ids=[b[0] for b in DISPATCH_BAD])
def test_dispatching_gemm_bad_input_is_a_clear_error(case, change, fragment):
    schedule, x, w = dispatch_case(*DISPATCH_CASES["uniform"], seed=12)
    with pytest.raises(RuntimeError, match=fragment):
        ops.dispatch_expert_gemm_swiglu(*change(x, schedule.slot_to_route, w, schedule.expert_offsets), *LAUNCH)


_FIRST_CALL_IN_CAPTURE = r"""
import torch
from megatron_mok import ops
from megatron_mok.backends.tuning import EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M
from megatron_mok.schedule import build_schedule_from_gathered

LAUNCH = (EXPERT_GEMM_CLUSTER_M, EXPERT_GEMM_GROUP_M)
torch.manual_seed(0)
ids = torch.rand(300, 6, device="cuda").topk(4, dim=1).indices
schedule = build_schedule_from_gathered(ids.unsqueeze(0), rank=0, num_local_experts=6, segment_alignment=8)
x = torch.randn(300, 256, device="cuda").bfloat16()
w1 = (torch.randn(6, 320, 256, device="cuda") / 16).bfloat16()
w2 = (torch.randn(6, 256, 160, device="cuda") / 16).bfloat16()
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):  # the extension's first launches happen while capturing
    rows, gate_up, act = ops.dispatch_expert_gemm_swiglu(x, schedule.slot_to_route, 4, w1, schedule.expert_offsets, *LAUNCH)
    out = ops.expert_gemm(act, w2, schedule.expert_offsets, *LAUNCH)
graph.replay()
torch.cuda.synchronize()
end = int(schedule.expert_offsets[-1])
want_rows = ops.dispatch_rows(x, schedule.slot_to_route, 4)
want_gate_up, want_act = ops.expert_gemm_swiglu(want_rows, w1, schedule.expert_offsets, *LAUNCH)
assert torch.equal(rows[:end], want_rows[:end]) and torch.equal(act[:end], want_act[:end])
assert torch.equal(out[:end], ops.expert_gemm(want_act, w2, schedule.expert_offsets, *LAUNCH)[:end])
print("ok")
"""


def test_first_call_inside_a_graph_capture():
    """The ops' one-time host work (tensor-map encoder lookup, function attributes, occupancy query,
    the timeout record) must not break a capture that makes the process's first launch."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", _FIRST_CALL_IN_CAPTURE], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


# The dgrad GEMMs take the weight as stored, (E, K, N) with N contiguous (MN-major B through a 3-D
# tensor map and transposed wgmma): same bound as the forward GEMM against fp32.
@pytest.mark.parametrize("case", list(CASES))
def test_expert_gemm_dgrad_matches_fp32(case):
    rows, k, n = CASES[case]
    a, w, offsets, offsets_host = make_case(rows, k, n, seed=zlib.crc32(case.encode()) % 1000 + 2)
    w_kn = w.transpose(1, 2).contiguous()  # (E, K, N): what fc1 and fc2 are for the dgrad products
    poison_allocator()
    out = ops.expert_gemm_dgrad(a, w_kn, offsets, EXPERT_GEMM_GROUP_M)
    assert out.shape == (a.shape[0], n) and out.dtype == torch.bfloat16
    ref, bound = fp32_reference_and_bound(a, w, offsets_host)
    assert_within(out[: offsets_host[-1]], ref, bound, "out")


@pytest.mark.parametrize("case", list(CASES))
def test_expert_gemm_dgrad_swiglu_equals_dgrad_then_swiglu_backward(case):
    """d gate_up from the fused epilogue is the SwiGLU-backward kernel applied to the dgrad GEMM's
    rounded output, bit for bit (same rounding, same formula)."""
    rows, hidden, ffn = CASES[case]
    grad_out, w, offsets, offsets_host = make_case(rows, hidden, ffn, seed=zlib.crc32(case.encode()) % 1000 + 3)
    fc2 = w.transpose(1, 2).contiguous()  # (E, H, F)
    gen = torch.Generator(device="cuda").manual_seed(7)
    gate_up = torch.randn(grad_out.shape[0], 2 * ffn, device="cuda", generator=gen).bfloat16()
    end = offsets_host[-1]
    grad_act = ops.expert_gemm_dgrad(grad_out, fc2, offsets, EXPERT_GEMM_GROUP_M)
    want = ops.swiglu_backward(gate_up, grad_act, offsets)
    poison_allocator()
    got = ops.expert_gemm_dgrad_swiglu(grad_out, fc2, offsets, gate_up, EXPERT_GEMM_GROUP_M)
    assert got.shape == want.shape
    assert torch.isfinite(got[:end]).all(), "unwritten elements"
    assert torch.equal(got[:end], want[:end])


def test_expert_gemm_dgrad_ops_registration_and_bad_input():
    a, w, offsets, _ = make_case([10, 0, 20], 64, 64, seed=8)
    w_kn = w.transpose(1, 2).contiguous()
    gate_up = torch.randn(a.shape[0], 128, device="cuda").bfloat16()
    calls = (
        (torch.ops.megatron_mok.expert_gemm_dgrad.default, (a, w_kn, offsets, 4)),
        (torch.ops.megatron_mok.expert_gemm_dgrad_swiglu.default, (a, w_kn, offsets, gate_up, 4)),
    )
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match=r"weight \(experts, K, N\)"):
        ops.expert_gemm_dgrad(a, w_kn[:, :32].contiguous(), offsets, EXPERT_GEMM_GROUP_M)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        ops.expert_gemm_dgrad_swiglu(a, w_kn, offsets, gate_up[:, :64].contiguous(), EXPERT_GEMM_GROUP_M)
    assert ops.last_failure() is None


@pytest.mark.parametrize("case", list(CASES))
def test_expert_gemm_wgrad_matches_fp32(case):
    """Weight gradients, tokens as the reduction dimension: each expert's rows only (the rows past
    the last segment are NaN here, so a last K block that read past its segment would show), zeros
    for an expert with no rows, bitwise reproducible."""
    rows, m, n = CASES[case]
    seed = zlib.crc32(case.encode()) % 1000 + 4
    grad, _, offsets, offsets_host = make_case(rows, m, 8, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    inputs = torch.randn(grad.shape[0], n, device="cuda", generator=gen).bfloat16()
    end = offsets_host[-1]
    grad[end:] = float("nan")
    inputs[end:] = float("nan")
    poison_allocator()
    out = ops.expert_gemm_wgrad(grad, inputs, offsets)
    assert out.shape == (len(rows), m, n) and out.dtype == torch.bfloat16
    for e in range(len(rows)):
        lo, hi = offsets_host[e], offsets_host[e + 1]
        g, x = grad[lo:hi].float(), inputs[lo:hi].float()
        ref = g.T @ x
        bound = tensor_core_bound(g.abs().T @ x.abs(), hi - lo, ref)
        assert_within(out[e], ref, bound, f"expert {e}")
    assert torch.equal(ops.expert_gemm_wgrad(grad, inputs, offsets), out)
    assert ops.last_failure() is None


def test_expert_gemm_wgrad_registration_and_bad_input():
    grad, _, offsets, _ = make_case([10, 0, 20], 64, 8, seed=9)
    inputs = torch.randn(grad.shape[0], 128, device="cuda").bfloat16()
    torch.library.opcheck(torch.ops.megatron_mok.expert_gemm_wgrad.default, (grad, inputs, offsets),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="same rows"):
        ops.expert_gemm_wgrad(grad, inputs[:-1].contiguous(), offsets)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        ops.expert_gemm_wgrad(grad[:, :60].contiguous(), inputs, offsets)
    with pytest.raises(RuntimeError, match="at least one expert"):
        ops.expert_gemm_wgrad(grad, inputs, offsets[:1])
