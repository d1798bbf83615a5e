"""The multi-process harness reports a failing rank (so the distributed tests can fail)."""

from __future__ import annotations

import pytest

from distributed import run_distributed


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
