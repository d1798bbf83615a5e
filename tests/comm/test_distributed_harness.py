"""The multi-process harness reports a failing rank (so the distributed tests can fail), and a rank
that never ends: killed at the deadline, its Python stack shown."""

from __future__ import annotations

import pytest

from distributed import run_distributed, spawn_ranks


def _fails_on_rank_one(rank, world_size):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    assert value.item() == sum(range(world_size))
    assert rank != 1, "rank 1 fails on purpose"


def test_a_failing_rank_fails_the_test():
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        run_distributed(_fails_on_rank_one, 2)


def _rank_one_never_ends(rank, world_size):
    import time

    while rank == 1:
        time.sleep(0.1)
    return "done"


def test_a_rank_that_never_ends_is_killed_at_the_deadline_with_its_stack(capfd):
    outcomes = spawn_ranks(_rank_one_never_ends, 2, timeout_s=20, stack_every_s=3)
    assert outcomes[0].returned and outcomes[0].result == "done", outcomes[0]
    assert outcomes[1].exitcode is None and outcomes[1].result is None, outcomes[1]
    # Where it waited: the body's frame, in its outcome and relayed to stderr under its rank.
    assert "_rank_one_never_ends" in outcomes[1].stacks, outcomes[1]
    err = capfd.readouterr().err
    assert "[rank 1 of 2]" in err and "_rank_one_never_ends" in err, err
    assert "spawn_ranks: rank 1 of 2 still running" in err and "no report" in err, err
