"""The layer over a real process group of R = 2, 4, 8 processes, each its own CUDA context, as a
Megatron launch at EP > 1 runs it: every rank's autograd in its own process, the regions and signal
counts per process, the host collectives over a gloo group. By default every process is on GPU 0
(the regions mapped by CUDA IPC, comm/cuda_ipc.py; the contexts time-slice the GPU, so this proves
the multi-process path, it does not time it); with MEGATRON_MOK_TEST_RANK_DEVICES=distinct rank r
is on GPU r (torch symmetric memory), as on a multi-GPU node. The bodies: tests/comm/ep_ranks.py.

Every spawn is bounded (spawn_ranks kills what still runs at its deadline and the test fails): a
hang is a failure, never a stuck test. The failing ranks' peers must end within the kernels' wait
bound (limits.WAIT_TIMEOUT_NS, 10 s) plus start-up.
"""

from __future__ import annotations

import pytest
import torch

from cuda_checks import NEEDS_HOPPER_KERNELS
from distributed import GPU_RANK_ENV, assert_every_rank_returned, spawn_ranks
import ep_ranks

pytestmark = NEEDS_HOPPER_KERNELS

GROUP_SIZES = [2, 4, 8]
# A spawn's deadline: start-up (import, CUDA context, extension) of every process, the checks, and
# the kernels' 10 s wait bound where a rank fails; far above what a passing run takes.
SPAWN_TIMEOUT_S = 240
# The survivors' end: the 10 s wait bound, the trap and the report, with margin (and on one GPU the
# survivors' stagger, at most half the bound: ep_ranks._stagger_survivor).
FAILURE_BOUND_S = 40


def _mode(num_ranks: int) -> str:
    mode = ep_ranks.rank_devices()
    if mode == "distinct" and torch.cuda.device_count() < num_ranks:
        pytest.skip(f"{ep_ranks.RANK_DEVICES}=distinct needs {num_ranks} GPUs, {torch.cuda.device_count()} here")
    return mode


def _spawn(body, num_ranks, *args):
    return spawn_ranks(body, num_ranks, *args, timeout_s=SPAWN_TIMEOUT_S, env=GPU_RANK_ENV)


@pytest.mark.parametrize("num_ranks", GROUP_SIZES)
def test_process_group_layer_equals_ep1_bitwise(num_ranks):
    """Every routing, one window and several, sm90 with a ring, two calls in a row, unequal shapes,
    the `auto` choice: bitwise EP = 1 on every rank (ep_ranks.layer_checks)."""
    mode = _mode(num_ranks)
    outcomes = spawn_ranks(ep_ranks.layer_checks, num_ranks, mode, timeout_s=SPAWN_TIMEOUT_S, env=GPU_RANK_ENV,
                           barrier_at_end=True)
    assert_every_rank_returned(outcomes)
    results = [o.result for o in outcomes]
    step_ms = max(r["step_ms"] for r in results)
    print(f"\nR = {num_ranks} processes ({mode} GPUs, {results[0]['memory']}): {results[0]['checks']} bitwise checks "
          f"per rank; forward + backward {step_ms:.1f} ms (median of {ep_ranks.TIMED_STEPS}, the slowest rank)")


def _survivors(outcomes):
    return [o for o in outcomes[:-1]]


@pytest.mark.parametrize("when", ["second_call", "mid_step"])
@pytest.mark.parametrize("num_ranks", GROUP_SIZES)
def test_a_rank_that_leaves_fails_every_other_rank_with_the_named_wait(num_ranks, when):
    """The last rank leaves before the second call, or raises between its forward and its backward:
    every other rank's bounded wait ends its call with a record naming the exchange phase, the
    missing peer and the call, within the bound."""
    mode = _mode(num_ranks)
    outcomes = _spawn(ep_ranks.never_arrives, num_ranks, mode, when)
    leaver = num_ranks - 1
    assert outcomes[leaver].exitcode is not None, "the leaving rank did not end"
    if when == "mid_step":
        assert "fails on purpose" in (outcomes[leaver].error or ""), outcomes[leaver]
    phases = _phase_names()
    for outcome in _survivors(outcomes):
        assert outcome.returned, f"rank {outcome.rank} did not report: {outcome}"
        report = outcome.result
        record = report["record"] or ""
        assert report["error"] is not None, f"rank {outcome.rank}: its call ended without an error: {report}"
        assert f"peer {leaver}" in record and "call" in record, f"rank {outcome.rank}: {report}"
        assert any(phase in record for phase in phases), f"rank {outcome.rank}: no exchange phase named: {report}"
        assert report["seconds"] < FAILURE_BOUND_S, f"rank {outcome.rank}: ended after {report['seconds']:.0f} s"


def _phase_names() -> tuple[str, ...]:
    from megatron_mok import ops

    return ops.exchange_phase_names()


@pytest.mark.parametrize("num_ranks", GROUP_SIZES)
def test_a_rank_that_leaves_before_the_first_call_fails_every_other_rank_on_the_host(num_ranks):
    """Before the group's first call nothing is on the device yet: the others' first host
    collective (the choice of symmetric memory) fails at once, naming the rank and the collective."""
    mode = _mode(num_ranks)
    outcomes = _spawn(ep_ranks.never_arrives, num_ranks, mode, "first_call")
    for outcome in _survivors(outcomes):
        assert outcome.returned, f"rank {outcome.rank} did not report: {outcome}"
        error = outcome.result["error"] or ""
        assert f"rank {outcome.rank} of the expert-parallel group" in error and "the choice of symmetric memory" in error, outcome
        assert outcome.result["seconds"] < FAILURE_BOUND_S, outcome


@pytest.mark.parametrize("num_ranks", GROUP_SIZES)
def test_a_bad_expert_id_on_one_rank_is_the_same_error_on_every_rank(num_ranks):
    mode = _mode(num_ranks)
    outcomes = _spawn(ep_ranks.bad_expert_id, num_ranks, mode)
    for outcome in outcomes:
        assert outcome.returned, f"rank {outcome.rank} did not report: {outcome}"
        report = outcome.result
        assert report["error"] is not None, f"rank {outcome.rank}: no error: {report}"
        assert "schedule kernel: topk_ids holds an expert id outside [-1, num_experts)" in (report["record"] or ""), (
            f"rank {outcome.rank}: {report}"
        )
        assert report["seconds"] < FAILURE_BOUND_S, report
