"""The layer over a real process group, one process per rank: the bodies that
tests/comm/test_gpu_processes.py runs in R spawned processes (tests/distributed.py spawn_ranks, a
gloo group for the host collectives), either all on one GPU (the ranks' regions mapped by CUDA IPC)
or one GPU each (torch symmetric memory; scripts/device_ep8.sh on a multi-GPU node).

Every check is against EP = 1 on the concatenated problem (R*T tokens, R*E_local experts), bitwise:
a row's GEMM and a token's fixed-order sum over k are the same arithmetic wherever they run, and the
schedule orders each expert's rows by (source rank, token, k) in both (tests/comm/test_emulation.py).
Each rank computes the EP = 1 reference itself (the problem is drawn from one seed on every rank)
and compares its own slice: its tokens' y, dx and d topk_weights, its experts' dfc1 and dfc2.

Notation: R ranks, T tokens per rank, H hidden, F expert FFN, E local experts per rank, K top-k.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import zlib

import torch
import torch.distributed as dist

from megatron_mok import MoKConfig, mok_moe, ops
from megatron_mok.limits import WAIT_TIMEOUT_NS
from test_emulation import ROUTINGS, make_problem, run_concatenated

# MEGATRON_MOK_TEST_RANK_DEVICES: "shared" (default), every rank on GPU 0; "distinct", rank r on GPU r.
RANK_DEVICES = "MEGATRON_MOK_TEST_RANK_DEVICES"

# Per group size: (T, H, F, E, K) per rank. Small: R processes time-slice one GPU, and every signal
# round between them costs milliseconds (/work/shared/DESIGN.md §8).
SHAPES = {
    2: (96, 256, 128, 3, 4),
    4: (64, 256, 128, 2, 4),
    8: (32, 256, 128, 2, 8),
}
# A receive capacity of a quarter of a rank's routes runs several windows at every shape (asserted).
CONFIGS = {
    "auto": MoKConfig(backend="kernel", exchange="symmetric"),
    "auto_windows": MoKConfig(backend="kernel", exchange="symmetric", receive_capacity_factor=0.25),
    "sm90_ring3_windows": MoKConfig(
        backend="kernel", exchange="symmetric", expert_gemm="sm90", dispatch_ring_minibatches=3, receive_capacity_factor=0.25
    ),
    # FP8 rows and scales through the processes' regions (H and F are multiples of 128 at every shape).
    "fp8": MoKConfig(backend="kernel", exchange="symmetric", precision="fp8_blockwise"),
    "fp8_windows": MoKConfig(backend="kernel", exchange="symmetric", precision="fp8_blockwise", receive_capacity_factor=0.25),
}
TIMED_STEPS = 5


def rank_devices() -> str:
    mode = os.environ.get(RANK_DEVICES, "shared")
    if mode not in ("shared", "distinct"):
        raise ValueError(f"{RANK_DEVICES} must be 'shared' or 'distinct', got {mode!r}")
    return mode


def expected_memory(mode: str) -> str:
    return "cuda_ipc" if mode == "shared" else "torch_symmetric"


def start_rank(rank: int, mode: str) -> torch.device:
    device = torch.device("cuda", 0 if mode == "shared" else rank)
    torch.cuda.set_device(device)
    return device


def problem_for(num_ranks: int, routing: str, seed_text: str):
    t, h, f, e, k = SHAPES[num_ranks]
    return make_problem(num_ranks, t, h, f, e, k, routing, "cuda", torch.bfloat16, zlib.crc32(seed_text.encode()))


def run_rank(problem, rank: int, local_experts: int, config: MoKConfig):
    """This rank's layer call over the world group, forward and backward: (y, [dx, dw, dfc1, dfc2])."""
    x, ids, weights, fc1, fc2, grad = problem
    own = slice(rank * local_experts, (rank + 1) * local_experts)
    leaves = [t.clone().requires_grad_() for t in (x[rank], weights[rank], fc1[own], fc2[own])]
    y = mok_moe(leaves[0], ids[rank], leaves[1], leaves[2], leaves[3], group=dist.group.WORLD, config=config)
    y.backward(grad[rank])
    return y.detach(), [leaf.grad for leaf in leaves]


def rank_slice(reference, rank: int, num_tokens: int, local_experts: int):
    """This rank's part of the EP = 1 results on the concatenated problem."""
    y, (dx, dw, dfc1, dfc2) = reference
    mine = slice(rank * num_tokens, (rank + 1) * num_tokens)
    own = slice(rank * local_experts, (rank + 1) * local_experts)
    return y[mine], [dx[mine], dw[mine], dfc1[own], dfc2[own]]


def assert_bitwise(got, want, what: str) -> None:
    (y, grads), (y_want, grads_want) = got, want
    assert torch.equal(y, y_want), f"{what}: y differs from EP = 1 on the concatenated problem"
    for name, a, b in zip(("dx", "d topk_weights", "dfc1", "dfc2"), grads, grads_want):
        assert torch.equal(a, b), f"{what}: {name} differs from EP = 1 on the concatenated problem"


def layer_checks(rank: int, num_ranks: int, mode: str) -> dict:
    """Every routing and config of CONFIGS over the world group, bitwise EP = 1; the `auto` choice;
    unequal shapes; the first case again at the end (the signal counts carried on over every call
    between); a median forward + backward time. Returns a summary."""
    from megatron_mok.comm import exchange_for, get_expert_parallel_group
    from megatron_mok.comm.exchange import exchange_notes
    from megatron_mok.comm.symmetric_exchange import SymmetricExchange
    from megatron_mok.functional import segment_alignment_for
    from megatron_mok.receive import receive_plan

    device = start_rank(rank, mode)
    t, h, f, e, k = SHAPES[num_ranks]
    ep_group = get_expert_parallel_group(dist.group.WORLD, device)
    # `auto` over a group whose ranks can share symmetric memory takes the in-kernel exchange, on
    # every rank alike, and says so once.
    assert isinstance(exchange_for(ep_group, "auto"), SymmetricExchange), "auto did not pick the in-kernel exchange"
    memory = ep_group.symmetric_memory()
    assert memory.kind == expected_memory(mode), memory
    assert any("in-kernel exchange" in note for note in exchange_notes), exchange_notes

    # Unequal shapes: a ValueError on every rank at the shape agreement, before any exchange.
    extra = 8 if rank == 0 else 0
    x = torch.randn(t + extra, h, device=device).bfloat16()
    ids = torch.zeros(t + extra, k, dtype=torch.int64, device=device)
    w = torch.rand(t + extra, k, device=device)
    fc1 = torch.randn(e, 2 * f, h, device=device).bfloat16()
    fc2 = torch.randn(e, h, f, device=device).bfloat16()
    try:
        mok_moe(x, ids, w, fc1, fc2, group=dist.group.WORLD, config=CONFIGS["auto"])
        raise AssertionError("unequal shapes raised nothing")
    except ValueError as error:
        assert "different shapes" in str(error), error

    for name, config in CONFIGS.items():
        if config.receive_capacity_factor < 1:
            plan = receive_plan(num_ranks=num_ranks, num_tokens=t, topk=k, num_local_experts=e,
                                segment_alignment=segment_alignment_for(config),
                                factor=config.receive_capacity_factor, windowed=True)
            assert plan.num_windows > 1, (name, plan)

    checks = 0
    first = None
    for routing in ROUTINGS:
        for name, config in CONFIGS.items():
            problem = problem_for(num_ranks, routing, f"{num_ranks}/{routing}")
            got = run_rank(problem, rank, e, config)
            want = rank_slice(run_concatenated(problem, dataclasses.replace(config, exchange="auto")), rank, t, e)
            assert_bitwise(got, want, f"rank {rank} of {num_ranks}, {routing}, {name}")
            checks += 1
            if first is None:
                first = (problem, config, got)
    # The first case again: the regions are reused and every signal count has moved on since.
    problem, config, got_first = first
    assert_bitwise(run_rank(problem, rank, e, config), got_first, f"rank {rank} of {num_ranks}, the first case again")
    checks += 1

    # One forward + backward of the first case, timed on each rank (the ranks meet in it).
    times = []
    for _ in range(TIMED_STEPS):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        run_rank(problem, rank, e, config)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return dict(checks=checks, step_ms=statistics.median(times), memory=memory.kind)


# ---- failures ------------------------------------------------------------------------------------


def _failure_problem(num_ranks: int):
    return problem_for(num_ranks, "uniform", f"failure/{num_ranks}")


def _finish_with_record(error: BaseException | None, start: float) -> dict:
    """A surviving rank's report: how its call ended, what the kernel recorded, how long it took."""
    if error is None:
        try:
            torch.cuda.synchronize()
        except RuntimeError as sync_error:
            error = sync_error
    return dict(
        error=None if error is None else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
        record=ops.last_failure(),
        seconds=time.monotonic() - start,
    )


def _stagger_survivor(rank: int, num_ranks: int, mode: str) -> None:
    """Survivor r starts its wait for the missing peer r steps after survivor 0, when every rank
    shares one GPU. Unstaggered, the survivors start those waits within milliseconds of each other
    and share one bound, so R - 1 contexts of one GPU would trap together: the one condition that no
    passing run had (at R = 2 the one survivor traps alone) and the first suspect of the survivors
    not ending at R = 4. A step of at most 1 s keeps the last survivor's signals well inside survivor
    0's bound, so every record still names the missing peer. On distinct GPUs the traps are on
    different devices: no stagger."""
    if mode != "shared" or num_ranks <= 2:
        return
    step_s = min(1.0, WAIT_TIMEOUT_NS / 1e9 / (2 * (num_ranks - 2)))
    time.sleep(rank * step_s)


def never_arrives(rank: int, num_ranks: int, mode: str, when: str) -> dict:
    """The last rank leaves: before the first call ("first_call"; the others' first host
    collective fails), before the second ("second_call"; the others' routing wait times out), or
    between its forward and its backward ("mid_step", by raising; the others' backward waits time
    out). Every other rank reports how its call ended (_finish_with_record)."""
    start_rank(rank, mode)
    dist.barrier()  # every rank's process group is up before the leaver can leave
    _, _, _, e, _ = SHAPES[num_ranks]
    problem = _failure_problem(num_ranks)
    config = CONFIGS["auto"]
    leaver = rank == num_ranks - 1
    if when == "first_call" and leaver:
        return dict(left=True)
    if when == "second_call":
        run_rank(problem, rank, e, config)
        torch.cuda.synchronize()
        if leaver:
            return dict(left=True)
        _stagger_survivor(rank, num_ranks, mode)
    start = time.monotonic()
    error = None
    try:
        x, ids, weights, fc1, fc2, grad = problem
        own = slice(rank * e, (rank + 1) * e)
        leaves = [t.clone().requires_grad_() for t in (x[rank], weights[rank], fc1[own], fc2[own])]
        y = mok_moe(leaves[0], ids[rank], leaves[1], leaves[2], leaves[3], group=dist.group.WORLD, config=config)
        if when == "mid_step" and leaver:
            torch.cuda.synchronize()
            raise RuntimeError(f"rank {rank} fails on purpose between its forward and its backward")
        if when == "mid_step":
            _stagger_survivor(rank, num_ranks, mode)  # (the backward's first wait is the one that times out)
        y.backward(grad[rank])
    except RuntimeError as raised:
        if when == "mid_step" and leaver:
            raise
        error = raised
    return _finish_with_record(error, start)


def bad_expert_id(rank: int, num_ranks: int, mode: str) -> dict:
    """Rank 0 passes an expert id past the group's experts: every rank's schedule kernel reads the
    whole group's ids, so every rank stops with the same named check."""
    start_rank(rank, mode)
    t, h, f, e, k = SHAPES[num_ranks]
    x, ids, weights, fc1, fc2, grad = _failure_problem(num_ranks)
    ids = ids.clone()
    if rank == 0:
        ids[0, t // 2, 0] = num_ranks * e  # one past the last expert of the group
    own = slice(rank * e, (rank + 1) * e)
    start = time.monotonic()
    error = None
    try:
        mok_moe(x[rank], ids[rank], weights[rank], fc1[own], fc2[own], group=dist.group.WORLD, config=CONFIGS["auto"])
    except RuntimeError as raised:
        error = raised
    return _finish_with_record(error, start)
