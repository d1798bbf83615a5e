"""Per-rank memory of emulated ranks: each rank's forward and backward run alone on the host (the
symmetric exchange launches ranks one after the other), so the allocator's counters during one
rank's body see only that rank's allocations, the same sequence a real rank makes.

    stats = per_rank_memory(group, problem, local_experts, config)  # one dict per rank

Every figure is in bytes above what was allocated when the body began: fwd_peak (the most during
the forward), held (what the forward left: y and the saved context), bwd_peak (the most during the
backward, above the held), peak = max(fwd_peak, held + bwd_peak), the figure bench_layer.py reports
for a one-rank layer (its forward + backward peak above what was allocated before).
"""

from __future__ import annotations

import torch

from megatron_mok import fp8_weights, functional


def _measure(body):
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = body()
    return result, torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before


def per_rank_memory(group, problem, local_experts, config, fresh_weight_copies: bool = False) -> list[dict]:
    """problem: test_emulation.make_problem's tensors. group: None for one rank (EP = 1).
    fresh_weight_copies: empty the FP8 weight cache before the measured call, so that it makes its
    weights' copies as the first call after an optimizer step does (they stay held after it)."""
    x, ids, weights, fc1, fc2, grad = problem
    num_ranks = x.shape[0]
    e = local_experts
    args = [(x[r], ids[r], weights[r], fc1[r * e:(r + 1) * e].contiguous(), fc2[r * e:(r + 1) * e].contiguous(), grad[r].contiguous())
            for r in range(num_ranks)]
    stats = [dict() for _ in range(num_ranks)]

    def forward(r):
        xr, ir, wr, f1, f2, _ = args[r]
        rank_group = None if group is None else group.ranks[r]
        (y, ctx), fwd_peak, held = _measure(lambda: functional.forward(xr, ir, wr, f1, f2, group=rank_group, config=config))
        stats[r].update(fwd_peak=fwd_peak, held=held)
        return y, ctx

    def backward(r, outs):
        _, _, _, f1, f2, dy = args[r]
        grads, bwd_peak, _ = _measure(lambda: functional.backward(outs[r][1], dy, f1, f2, release_saved=True))
        stats[r].update(bwd_peak=bwd_peak, peak=max(stats[r]["fwd_peak"], stats[r]["held"] + bwd_peak))
        return grads

    for measured in (False, True):  # the first call warms the allocator and makes the symmetric regions
        if measured and fresh_weight_copies:
            fp8_weights.clear()
        _step(group, forward, backward, x, ids)
        torch.cuda.synchronize()
    return stats


def _step(group, forward, backward, x, ids) -> None:
    if group is None:
        outs = [forward(0)]
        backward(0, outs)
        return
    group.prepare(x.shape[1], x.shape[2], ids.shape[2], x.dtype)
    outs = group.run_launched(forward)
    group.run_launched(lambda r: backward(r, outs))
