"""CUDA-graph capture of a forward + backward step, replayed against eager results."""

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
