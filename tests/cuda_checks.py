"""Checks of a forward + backward step on a CUDA device: graph replay and sync-free reproducibility."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def assert_graph_replays_eager(
    step: Callable[[], torch.Tensor],
    leaves: Sequence[torch.Tensor],
    eager_y: torch.Tensor,
    eager_grads: Sequence[torch.Tensor],
) -> None:
    """Captures `step` (which resets and fills leaves' grads, returns y) and checks two replays
    reproduce the eager output and gradients bit for bit."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs requires
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, eager_y)
        for leaf, want in zip(leaves, eager_grads):
            assert torch.equal(leaf.grad, want)


def assert_bitwise_reproducible_without_host_sync(
    run: Callable[[], tuple[torch.Tensor, Sequence[torch.Tensor]]],
) -> None:
    """Runs `run` (-> y, grads) twice with host synchronization turned into an error, after one
    warm-up (lazy initialization may synchronize once), and checks both runs agree bit for bit."""
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y1, g1 = run()
        y2, g2 = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
