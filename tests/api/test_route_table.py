"""The route table forward keeps for backward (functional._combine_keeping_table): where the exchange
returns its table in a buffer it reuses (the in-kernel exchange's combine region), the combine writes
backward's copy of every row it reads, and the buffer is released only after that combine; elsewhere
the table is the exchange's own tensor, kept as it is."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import functional
from megatron_mok.backends import reference, stages_for


class _Returned:
    """A ReturnedRows over a fixed table, recording the calls in order."""

    def __init__(self, table: torch.Tensor, reused: bool, calls: list):
        self.region, self.table_in_reused_buffer, self.calls = table, reused, calls

    def table(self, keep: bool) -> torch.Tensor:
        self.calls.append(("table", keep))
        return self.region.clone() if keep else self.region

    def release(self) -> None:
        self.calls.append(("release",))


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, topk, hidden = 11, 3, 16
    table = torch.randn(num_tokens * topk + 5, hidden, generator=gen).bfloat16()  # 5 rows no route reads
    index = torch.randperm(num_tokens * topk, generator=gen)
    index[::4] = -1  # dropped routes
    weights = torch.rand(num_tokens, topk, generator=gen)
    return table, index, weights, topk


@pytest.mark.parametrize("reused", [True, False])
def test_the_kept_table_serves_backward_as_the_region_did(reused):
    table, index, weights, topk = _inputs()
    calls = []
    stages = stages_for("reference", "auto", None)
    returned = _Returned(table, reused, calls)
    kept, y = functional._combine_keeping_table(stages, returned, index, weights, topk, torch.bfloat16)
    assert torch.equal(y, reference.combine(table, index, weights, topk, torch.bfloat16))
    read = index[index >= 0]
    assert torch.equal(kept[read], table[read])
    assert kept.data_ptr() != table.data_ptr()  # a tensor of forward's own, whatever the exchange reuses
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(reference.route_weight_grads(grad_y, kept, index, topk),
                       reference.route_weight_grads(grad_y, table, index, topk))
    if reused:
        assert calls == [("table", False), ("release",)]  # released after the combine read it
    else:
        assert calls == [("table", True)]


def test_the_reference_combine_copies_its_table_into_keep():
    """Stages.combine's keep in the reference: the whole table into keep's first rows, nothing past them
    (the kernel's, which copies only the rows routes read: tests/backends/test_gpu_kernels.py)."""
    table, index, weights, topk = _inputs(2)
    keep = torch.full((table.shape[0] + 2, table.shape[1]), float("nan")).bfloat16()
    y = reference.combine(table, index, weights, topk, torch.bfloat16, keep=keep)
    assert torch.equal(y, reference.combine(table, index, weights, topk, torch.bfloat16))
    assert torch.equal(keep[: table.shape[0]], table)
    assert keep[table.shape[0]:].isnan().all()


def test_a_kept_copy_overlapping_its_table_is_refused_before_any_kernel():
    from megatron_mok import ops

    table, index, weights, topk = _inputs(3)
    with pytest.raises(ValueError, match="keep must not overlap table"):
        ops.combine_keeping(table, index, weights, topk, table[1:])
