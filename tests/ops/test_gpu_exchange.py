"""The in-kernel exchange's ops on a Hopper GPU, R "ranks" as separate allocations on one device
(comm/symmetric.py emulated_allocator, the layout torch symmetric memory gives one per GPU).

Everything here is exact: the pulls and pushes move bytes (and the reverse-combine pull does the one
fp32 multiply the one-tensor gather does), so each must equal the one-tensor op on the concatenated
regions bit for bit; the signal protocol is checked by the values each call reads.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_mok import limits, ops
from megatron_mok.backends.tuning import EXPERT_GEMM_GROUP_M
from megatron_mok.comm.symmetric import emulated_allocator
from megatron_mok.schedule import build_schedule_from_gathered
from cuda_checks import NEEDS_HOPPER_KERNELS, TRAP_SCRIPT_TAIL, poison_allocator, run_until_trap

pytestmark = NEEDS_HOPPER_KERNELS

READY, FREE = 0, 1

# (num_ranks, num_tokens, hidden, local_experts, topk, dtype); hidden 36 bf16 (72-byte rows) and 9
# fp32 take the one-element path, the others 16-byte packs.
CASES = {
    "r2": (2, 37, 64, 3, 4, torch.bfloat16),
    "r4": (4, 100, 256, 2, 8, torch.bfloat16),
    "r8": (8, 16, 512, 1, 8, torch.bfloat16),
    "r8_t1": (8, 1, 64, 2, 2, torch.bfloat16),
    "r4_unaligned_rows": (4, 21, 36, 3, 3, torch.bfloat16),
    "r2_fp32": (2, 33, 96, 2, 4, torch.float32),
    "r4_fp32_unaligned_rows": (4, 10, 9, 2, 2, torch.float32),
}
ROUTINGS = ("uniform", "all_to_rank0_expert0", "all_to_last_rank", "dropped")


def make_ids(num_ranks, num_tokens, local_experts, topk, routing, gen):
    """(R, T, K) int64 global expert ids of every rank."""
    num_experts = num_ranks * local_experts
    scores = torch.rand(num_ranks, num_tokens, num_experts, device="cuda", generator=gen)
    ids = scores.topk(min(topk, num_experts), dim=-1).indices
    if ids.shape[-1] < topk:
        ids = torch.cat([ids, ids[..., : topk - ids.shape[-1]]], dim=-1)
    if routing == "all_to_rank0_expert0":
        ids.fill_(0)
    elif routing == "all_to_last_rank":
        ids = (num_ranks - 1) * local_experts + ids % local_experts
    elif routing == "dropped":
        ids = torch.where(torch.rand(ids.shape, device="cuda", generator=gen) < 0.3, -1, ids)
    return ids


def regions(num_ranks, shape, dtype):
    """Every rank's copy of one region: (copies in rank order, the peer pointer table)."""
    allocate = emulated_allocator(num_ranks, torch.device("cuda"))
    per_rank = [allocate(r)(tuple(shape), dtype) for r in range(num_ranks)]
    assert len({region.peer_ptrs for region in per_rank}) == 1
    return [region.own for region in per_rank], list(per_rank[0].peer_ptrs)


def filled_regions(num_ranks, shape, dtype, gen):
    copies, ptrs = regions(num_ranks, shape, dtype)
    for rank, copy in enumerate(copies):
        copy.copy_(torch.randn(shape, device="cuda", generator=gen).to(dtype))
        if copy.dim() == 2:
            copy[:, 0] = rank  # a row pulled from the wrong rank shows at once
    return copies, ptrs


def case_inputs(case, routing, rank=None):
    num_ranks, t, h, e, k, dtype = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{case}/{routing}".encode()))
    ids = make_ids(num_ranks, t, e, k, routing, gen)
    rank = num_ranks - 1 if rank is None else rank
    schedule = build_schedule_from_gathered(ids, rank=rank, num_local_experts=e, segment_alignment=8)
    return gen, ids, schedule


def pull_sources(case, routing):
    """A case's schedule and every rank's `tokens` (filled) and `grad_weights` (random) regions:
    (schedule, token copies, token ptrs, weight copies, weight ptrs)."""
    num_ranks, t, h, e, k, dtype = CASES[case]
    gen, _, schedule = case_inputs(case, routing)
    tokens, token_ptrs = filled_regions(num_ranks, (t, h), dtype, gen)
    weights, weight_ptrs = regions(num_ranks, (t * k,), torch.float32)
    for copy in weights:
        copy.copy_(torch.rand(t * k, device="cuda", generator=gen))
    return schedule, tokens, token_ptrs, weights, weight_ptrs


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", list(CASES))
def test_pulls_from_peers_equal_the_one_tensor_gathers_bitwise(case, routing):
    num_ranks, t, h, e, k, dtype = CASES[case]
    schedule, tokens, token_ptrs, weights, weight_ptrs = pull_sources(case, routing)
    x_all, w_all = torch.cat(tokens), torch.cat(weights)
    for rank in range(num_ranks):  # any rank's own copy stands for the region
        poison_allocator(1 << 28)
        got = ops.dispatch_rows_from_peers(tokens[rank], token_ptrs, schedule.slot_to_route, k)
        assert torch.equal(got, ops.dispatch_rows(x_all, schedule.slot_to_route, k)), f"dispatch, own rank {rank}"
        got = ops.pull_grad_rows_from_peers(tokens[rank], token_ptrs, weight_ptrs, schedule.slot_to_route, k)
        want = ops.pull_grad_rows(x_all, w_all, schedule.slot_to_route, k)
        assert torch.equal(got, want), f"pull_grad_rows, own rank {rank}"


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", ["r4", "r4_unaligned_rows", "r2_fp32"])
def test_gathers_given_the_offsets_write_the_same_rows_up_to_the_schedules_end(case, routing):
    """With expert_offsets every gather writes rows [0, offsets[-1]) exactly as without. The rows past
    it are left unwritten (a receive window's unused tail costs no writes); their contents are not
    specified, so they are not compared (whatever the allocator handed out stays there)."""
    num_ranks, t, h, e, k, dtype = CASES[case]
    schedule, tokens, token_ptrs, weights, weight_ptrs = pull_sources(case, routing)
    x_all, w_all = torch.cat(tokens), torch.cat(weights)
    offsets = schedule.expert_offsets
    end = int(offsets[-1])
    # A window-like view: the schedule, then a tail of padding rows past its end.
    slots = torch.cat([schedule.slot_to_route, torch.full((300,), -1, device="cuda", dtype=torch.int64)])
    pulls = {
        "dispatch_rows": lambda o: ops.dispatch_rows(x_all, slots, k, o),
        "pull_grad_rows": lambda o: ops.pull_grad_rows(x_all, w_all, slots, k, o),
        "dispatch_rows_from_peers": lambda o: ops.dispatch_rows_from_peers(tokens[0], token_ptrs, slots, k, o),
        "pull_grad_rows_from_peers": lambda o: ops.pull_grad_rows_from_peers(tokens[0], token_ptrs, weight_ptrs, slots, k, o),
    }
    for name, pull in pulls.items():
        got = pull(offsets)
        assert got.shape == (slots.shape[0], h), name
        assert torch.equal(got[:end], pull(None)[:end]), name


# The dispatching GEMM from the peers: (num_ranks, num_tokens, hidden, local_experts, topk); every
# case has several minibatches of limits.DISPATCH_MINIBATCH_ROWS rows at the last rank, and T is
# not a multiple of the 128-row tile in r4 and r2_t1261 (one rank's rows end inside a tile).
GEMM_CASES = {
    "r4": (4, 700, 256, 2, 8),
    "r8": (8, 384, 128, 2, 8),
    "r2_t1261": (2, 1261, 192, 3, 6),
}


def dispatching_gemm_case(case, routing, ring, tokens_shape=None):
    num_ranks, t, h, e, k = GEMM_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{case}/{routing}".encode()) + ring)
    ids = make_ids(num_ranks, t, e, k, routing, gen)
    schedule = build_schedule_from_gathered(ids, rank=num_ranks - 1, num_local_experts=e, segment_alignment=128)
    fc1 = (torch.randn(e, 2 * 128, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    return gen, schedule, fc1


@pytest.mark.parametrize("ring", [0, 3])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_dispatching_gemm_from_peers_equals_the_one_tensor_kernel_bitwise(case, routing, ring):
    """The kernel's dispatch warps read each row from its rank's region (every base 16-byte
    aligned: no fallback): gate_up and act bitwise the one-tensor kernel's on the concatenated
    regions, and the ring (or the rows) holds the same rows."""
    num_ranks, t, h, e, k = GEMM_CASES[case]
    gen, schedule, fc1 = dispatching_gemm_case(case, routing, ring)
    tokens, ptrs = filled_regions(num_ranks, (t, h), torch.bfloat16, gen)
    assert all(ptr % 16 == 0 for ptr in ptrs)  # the kernel, not the wrapper's two-kernel fallback
    x_all = torch.cat(tokens)
    end = int(schedule.expert_offsets[-1])
    want = ops.dispatch_expert_gemm_swiglu(
        x_all, schedule.slot_to_route, k, fc1, schedule.expert_offsets, 2, EXPERT_GEMM_GROUP_M, ring_minibatches=ring
    )
    poison_allocator(1 << 28)
    got = ops.dispatch_expert_gemm_swiglu_from_peers(
        tokens[0], ptrs, schedule.slot_to_route, k, fc1, schedule.expert_offsets, 2, EXPERT_GEMM_GROUP_M, ring_minibatches=ring
    )
    assert got[0].shape == want[0].shape  # the ring's bound, as the one-tensor kernel's
    assert torch.equal(got[1][:end], want[1][:end]) and torch.equal(got[2][:end], want[2][:end])
    rows = ops.dispatch_rows(x_all, schedule.slot_to_route, k)
    if limits.dispatch_ring_holds_every_row(schedule.slot_to_route.shape[0], ring):
        assert torch.equal(got[0][:end], rows[:end])
    else:  # the ring holds the last ring_rows rows below the end, each at position r % ring_rows
        ring_rows = ring * limits.DISPATCH_MINIBATCH_ROWS
        last = torch.arange(max(0, end - ring_rows), end, device="cuda")
        assert torch.equal(got[0][last % ring_rows], rows[last])
    assert ops.last_failure() is None


@pytest.mark.parametrize("ring", [0, 3])
def test_dispatching_gemm_from_peers_off_16_bytes_falls_back_to_the_separate_pull(ring):
    """Bases 8 bytes off 16 (the kernel copies 16-byte units): the wrapper's two-kernel path, the
    same gate_up and act bitwise, and every row."""
    num_ranks, t, h, e, k = GEMM_CASES["r4"]
    gen, schedule, fc1 = dispatching_gemm_case("r4", "uniform", ring)
    flat, flat_ptrs = filled_regions(num_ranks, (t * h + 4,), torch.bfloat16, gen)
    tokens = [copy[4:].view(t, h) for copy in flat]
    for rank, copy in enumerate(tokens):
        copy[:, 0] = rank
    ptrs = [ptr + 8 for ptr in flat_ptrs]
    x_all = torch.cat(tokens)
    end = int(schedule.expert_offsets[-1])
    want = ops.dispatch_expert_gemm_swiglu(
        x_all, schedule.slot_to_route, k, fc1, schedule.expert_offsets, 2, EXPERT_GEMM_GROUP_M, ring_minibatches=ring
    )
    got = ops.dispatch_expert_gemm_swiglu_from_peers(
        tokens[0], ptrs, schedule.slot_to_route, k, fc1, schedule.expert_offsets, 2, EXPERT_GEMM_GROUP_M, ring_minibatches=ring
    )
    assert torch.equal(got[1][:end], want[1][:end]) and torch.equal(got[2][:end], want[2][:end])
    assert torch.equal(got[0][:end], ops.dispatch_rows(x_all, schedule.slot_to_route, k)[:end])
    with pytest.raises(RuntimeError, match="16-byte aligned"):  # the op itself refuses them
        torch.ops.megatron_mok.dispatch_expert_gemm_swiglu_from_peers(
            tokens[0], ptrs, schedule.slot_to_route, k, fc1, schedule.expert_offsets, 2, 16, 0
        )


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", list(CASES))
def test_push_rows_writes_every_route_to_its_source_slot(case, routing):
    """Every owner pushes its schedule's rows; each source's combine region must then hold, at slot
    t * K + k, the owner's row of that route, and be untouched at dropped routes."""
    num_ranks, t, h, e, k, dtype = CASES[case]
    gen, ids, _ = case_inputs(case, routing)
    sentinel = -7.0
    combine, ptrs = regions(num_ranks, (t * k, h), dtype)
    for copy in combine:
        copy.fill_(sentinel)
    schedules, slot_rows = [], []
    for owner in range(num_ranks):
        schedule = build_schedule_from_gathered(ids, rank=owner, num_local_experts=e, segment_alignment=8)
        schedules.append(schedule)
        slot_rows.append(torch.randn(schedule.capacity, h, device="cuda", generator=gen).to(dtype))
        ops.push_rows(slot_rows[owner], schedule.slot_to_route, k, t, combine[owner], ptrs)
    torch.cuda.synchronize()
    for source in range(num_ranks):
        flat = ids[source].reshape(-1)
        want = torch.full((t * k, h), sentinel, device="cuda", dtype=dtype)
        group_route = source * t * k + torch.arange(t * k, device="cuda")
        for owner in range(num_ranks):
            mine = (flat >= 0) & (flat // e == owner)
            want[mine] = slot_rows[owner][schedules[owner].route_to_slot[group_route[mine]]]
        assert torch.equal(combine[source], want), f"source {source}"


@pytest.mark.parametrize("dtype,shape", [(torch.int64, (37, 8)), (torch.int32, (5, 3)), (torch.bfloat16, (1, 7)), (torch.float32, (64,))])
@pytest.mark.parametrize("num_ranks", [1, 2, 8])
def test_gather_peer_regions(num_ranks, dtype, shape):
    copies, ptrs = regions(num_ranks, shape, dtype)
    for rank, copy in enumerate(copies):
        copy.copy_((torch.arange(copy.numel(), device="cuda").reshape(shape) * 10 + rank).to(dtype))
    got = ops.gather_peer_regions(copies[num_ranks // 2], ptrs)
    assert got.shape == (num_ranks, *shape) and torch.equal(got, torch.stack(copies))


# ---- the signal protocol -------------------------------------------------------------------------


class Ranks:
    """R ranks' signal pads, call counts and one data region, each rank with its own stream."""

    def __init__(self, num_ranks):
        self.num_ranks = num_ranks
        self.names = ops.exchange_phase_names()
        self.phase = self.names.index("tokens")
        self.signals, self.signal_ptrs = regions(num_ranks, (len(self.names), 2, num_ranks), torch.int64)
        self.calls = [torch.zeros(len(self.names), dtype=torch.int64, device="cuda") for _ in range(num_ranks)]
        self.data, self.data_ptrs = regions(num_ranks, (4,), torch.int64)
        self.streams = [torch.cuda.Stream() for _ in range(num_ranks)]

    def call(self, rank):
        """One call of the phase on `rank`'s current stream: publish a value that names the call
        (calls[phase] * 1000 + rank, computed on the device, so a graph replay publishes the next
        call's), read every rank's, release. Returns what it read, (R, 4)."""
        calls, signals = self.calls[rank], self.signals[rank]
        ops.exchange_begin(calls, signals, rank, self.phase)
        self.data[rank].copy_((calls[self.phase] * 1000 + rank).expand(4))
        ops.exchange_signal(calls, signals, self.signal_ptrs, rank, self.phase, READY)
        ops.exchange_wait_ready(calls, signals, rank, self.phase)
        got = ops.gather_peer_regions(self.data[rank], self.data_ptrs)
        ops.exchange_signal(calls, signals, self.signal_ptrs, rank, self.phase, FREE)
        return got

    def steps(self, num_calls):
        """num_calls calls on every rank, all launched from this thread, each rank on its own stream
        forked from the current one and joined back: the ranks meet on the device only."""
        main = torch.cuda.current_stream()
        results = [[None] * self.num_ranks for _ in range(num_calls)]
        for stream in self.streams:
            stream.wait_stream(main)
        for c in range(num_calls):
            for rank in range(self.num_ranks):
                with torch.cuda.stream(self.streams[rank]):
                    results[c][rank] = self.call(rank)
        for stream in self.streams:
            main.wait_stream(stream)
        return results


def expected_read(num_ranks, call):
    return (call * 1000 + torch.arange(num_ranks, device="cuda")).view(-1, 1).expand(num_ranks, 4)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_signal_protocol_orders_every_call_eager_and_in_one_cuda_graph(num_ranks):
    ranks = Ranks(num_ranks)
    results = ranks.steps(3)
    torch.cuda.synchronize()
    for c, per_rank in enumerate(results):
        for rank, got in enumerate(per_rank):
            assert torch.equal(got, expected_read(num_ranks, c + 1)), f"call {c + 1}, rank {rank}"

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = ranks.steps(2)
    for replay in range(2):  # the counts go on from the eager calls: no reset anywhere
        graph.replay()
        torch.cuda.synchronize()
        for c, per_rank in enumerate(static):
            call = 3 + 2 * replay + c + 1
            for rank, got in enumerate(per_rank):
                assert torch.equal(got, expected_read(num_ranks, call)), f"replay {replay}, call {call}, rank {rank}"
    for rank in range(num_ranks):
        assert int(ranks.calls[rank][ranks.phase]) == 7
        pad = ranks.signals[rank][ranks.phase]  # (2, R): every rank signalled ready and free 7 times
        assert torch.equal(pad, torch.full_like(pad, 7))
    assert ops.last_failure() is None


# Rank 1 publishes call 1 but never finishes reading it (no `free`); rank 0 then starts call 2,
# whose begin must wait for rank 1's free of call 1 until the bounded wait gives up.
NEVER_FREES = """
import torch
from megatron_mok import ops
from megatron_mok.comm.symmetric import emulated_allocator
names = ops.exchange_phase_names()
phase = names.index("tokens")
allocate = emulated_allocator(2, torch.device("cuda"))
pads = [allocate(r)((len(names), 2, 2), torch.int64) for r in range(2)]
ptrs = list(pads[0].peer_ptrs)
calls = [torch.zeros(len(names), dtype=torch.int64, device="cuda") for _ in range(2)]
streams = [torch.cuda.Stream() for _ in range(2)]
for r in range(2):
    with torch.cuda.stream(streams[r]):
        ops.exchange_begin(calls[r], pads[r].own, r, phase)
        ops.exchange_signal(calls[r], pads[r].own, ptrs, r, phase, 0)
        ops.exchange_wait_ready(calls[r], pads[r].own, r, phase)
with torch.cuda.stream(streams[0]):
    ops.exchange_signal(calls[0], pads[0].own, ptrs, 0, phase, 1)
    ops.exchange_begin(calls[0], pads[0].own, 0, phase)
""" + TRAP_SCRIPT_TAIL


def test_a_peer_that_never_frees_is_a_named_bounded_wait():
    record, out, elapsed = run_until_trap(NEVER_FREES)
    assert "tokens phase's free signal of peer 1 (call 2) timed out" in record, out
    assert elapsed < 10 + limits.WAIT_TIMEOUT_NS / 1e9 * 2, f"the bounded wait took {elapsed:.0f} s"


# ---- registration ----------------------------------------------------------------------------------


_ALIVE: list = []


def _op_args(name):
    """Arguments for one op on a one-rank group whose pad is far ahead (every wait passes at once,
    however often opcheck runs the op)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    t, h, e, k = 9, 64, 2, 2
    names = ops.exchange_phase_names()
    signals, signal_ptrs = regions(1, (len(names), 2, 1), torch.int64)
    signals[0].fill_(1 << 20)
    calls = torch.zeros(len(names), dtype=torch.int64, device="cuda")
    ids = make_ids(1, t, e, k, "dropped", gen)
    schedule = build_schedule_from_gathered(ids, rank=0, num_local_experts=e)
    tokens, ptrs = filled_regions(1, (t, h), torch.bfloat16, gen)
    weights, weight_ptrs = regions(1, (t * k,), torch.float32)
    combine, combine_ptrs = regions(1, (t * k, h), torch.bfloat16)
    rows = torch.randn(schedule.capacity, h, device="cuda", generator=gen).bfloat16()
    fc1 = (torch.randn(e, 32, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    # Every region an op reads through the pointer tables only must outlive this call.
    _ALIVE[:] = [signals, tokens, weights, combine]
    return {
        "exchange_begin": (calls, signals[0], 0, 1),
        "exchange_signal": (calls, signals[0], signal_ptrs, 0, 1, READY),
        "exchange_wait_ready": (calls, signals[0], 0, 1),
        "push_rows": (rows, schedule.slot_to_route, k, t, combine[0], combine_ptrs),
        "gather_peer_regions": (tokens[0], ptrs),
        "dispatch_rows_from_peers": (tokens[0], ptrs, schedule.slot_to_route, k),
        "pull_grad_rows_from_peers": (tokens[0], ptrs, weight_ptrs, schedule.slot_to_route, k),
        "dispatch_expert_gemm_swiglu_from_peers": (
            tokens[0], ptrs, schedule.slot_to_route, k, fc1, schedule.expert_offsets, 1, 16, 0,
        ),
    }[name]


EXCHANGE_OPS = (
    "exchange_begin", "exchange_signal", "exchange_wait_ready", "push_rows", "gather_peer_regions",
    "dispatch_rows_from_peers", "pull_grad_rows_from_peers", "dispatch_expert_gemm_swiglu_from_peers",
)


@pytest.mark.parametrize("name", EXCHANGE_OPS)
def test_exchange_op_registration(name):
    """Schema (declared mutations), fake implementation, and torch.compile(fullgraph=True)."""
    op = getattr(torch.ops.megatron_mok, name).default
    args = _op_args(name)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True)
    got, want = compiled(*args), op(*args)
    if isinstance(want, tuple):  # the dispatching GEMM: rows at or past expert_offsets[-1] stay unwritten
        end = int(args[5][-1])
        for part, (x, y) in enumerate(zip(got, want)):
            assert x.shape == y.shape and torch.equal(x[:end], y[:end]), f"result {part}"
    elif want is not None:
        assert torch.equal(got, want)


BAD_CALLS = [
    # (op, change to the arguments, message)
    ("dispatch_rows_from_peers", lambda a: (a[0], [], *a[2:]), "one address per rank, at most"),
    ("dispatch_rows_from_peers", lambda a: (a[0], [0], *a[2:]), "must be a non-null"),
    ("dispatch_rows_from_peers", lambda a: (a[0], [a[1][0] + 1], *a[2:]), "2-byte aligned"),
    ("dispatch_rows_from_peers", lambda a: (a[0], a[1] * (limits.MAX_EP_RANKS + 1), *a[2:]), "one address per rank, at most"),
    ("dispatch_rows_from_peers", lambda a: (a[0], a[1], a[2], 0), "topk must be in"),
    ("dispatch_rows_from_peers", lambda a: (a[0].half(), a[1], *a[2:]), "bfloat16 or float32"),
    ("pull_grad_rows_from_peers", lambda a: (a[0], a[1], a[2] + a[2], *a[3:]), "one address per rank"),
    ("dispatch_expert_gemm_swiglu_from_peers", lambda a: (a[0], [], *a[2:]), "one address per rank, at most"),
    ("dispatch_expert_gemm_swiglu_from_peers", lambda a: (a[0], [a[1][0] + 8], *a[2:]), "16-byte aligned"),
    ("dispatch_expert_gemm_swiglu_from_peers", lambda a: (a[0], a[1], a[2], 0, *a[4:]), "topk must be positive"),
    ("dispatch_expert_gemm_swiglu_from_peers", lambda a: (a[0].float(), *a[1:]), "must be bfloat16"),
    ("dispatch_expert_gemm_swiglu_from_peers", lambda a: (*a[:4], a[4][:, :24].contiguous(), *a[5:]), "gate and up rows"),
    ("dispatch_expert_gemm_swiglu_from_peers", lambda a: (*a[:8], 1), "ring_minibatches must be 0"),
    ("push_rows", lambda a: (a[0], a[1], a[2], a[3] + 1, *a[4:]), "own_combine must be"),
    ("exchange_begin", lambda a: (a[0], a[1], 1, a[3]), "rank must be in"),
    ("exchange_begin", lambda a: (a[0], a[1], 0, 9), "phase must be in"),
    ("exchange_signal", lambda a: (a[0], a[1], a[2], 0, 1, 2), "kind must be 0"),
]


@pytest.mark.parametrize("name,change,message", BAD_CALLS)
def test_exchange_op_bad_arguments_are_named_errors(name, change, message):
    op = getattr(torch.ops.megatron_mok, name)
    args = change(_op_args(name))
    with pytest.raises(RuntimeError, match=message):
        op(*args)
