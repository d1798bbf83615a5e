"""comm/placement.py: which symmetric memory a process group's ranks get, from what they report (a pure
function of the gathered list, so every rank decides alike). Runs anywhere: the placements are
written out, no GPU is asked."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_mok.comm.placement import RankPlacement, SETTING, choose

GPUS = tuple(f"GPU-{i:04d}" for i in range(8))


def _rank(index: int, *, host: str = "node0", peers: bool = True, visible=GPUS, extension_error=None, requested="auto"):
    own = visible[index]
    return RankPlacement(
        host=host, device_index=index, visible_uuids=tuple(visible),
        peer_uuids=tuple(u for u in visible if u != own) if peers else (),
        extension_error=extension_error, requested=requested,
    )


def _node(num_ranks: int, **kwargs):
    """Rank r on GPU r of one node (torchrun's layout)."""
    return [_rank(r, **kwargs) for r in range(num_ranks)]


def _shared(num_ranks: int, **kwargs):
    """Every rank on GPU 0."""
    return [_rank(0, **kwargs) for _ in range(num_ranks)]


# name: (placements, expected kind, a fragment of the reason / description)
CASES = {
    "one_gpu_per_rank": (_node(8), "torch_symmetric", "8 GPUs of one node"),
    "one_rank": (_node(1), "torch_symmetric", "1 GPUs"),
    "ranks_share_one_gpu": (_shared(4), "cuda_ipc", "4 ranks are processes on one GPU"),
    "no_peer_access": (_node(2, peers=False), None, "rank 0's GPU has no peer access to rank 1's"),
    "two_nodes": ([_rank(0, host="a"), _rank(1, host="b")], None, "spans several nodes"),
    "extension_missing_on_one_rank": (
        [_rank(0), _rank(1, extension_error="ImportError: no _C")], None, "not available on rank 1"
    ),
    # Ranks 0 and 1 on GPU 0, rank 2 on GPU 1: torch symmetric memory refuses it, IPC maps it.
    "some_share": ([_rank(0), _rank(0), _rank(1)], "cuda_ipc", "3 processes on 2 GPUs"),
    # Each process sees the two GPUs in another order: an IPC handle names its exporter's index, which
    # would open the wrong GPU in the importer.
    "ipc_other_index": (
        [_rank(0, visible=GPUS[:2], requested="cuda_ipc"), _rank(0, visible=GPUS[1::-1], requested="cuda_ipc")],
        None, "rank 0 sees rank 1's GPU under another device index",
    ),
    "asked_for_ipc_on_a_node": (_node(4, requested="cuda_ipc"), "cuda_ipc", "4 processes on 4 GPUs"),
    "asked_for_torch_on_a_shared_gpu": (_shared(2, requested="torch_symmetric"), None, "one GPU per rank"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_choose(case):
    placements, kind, fragment = CASES[case]
    memory = choose(placements)
    assert memory.kind == kind, memory
    assert fragment in memory.why, memory


def test_a_setting_that_differs_between_ranks_is_an_error_on_every_rank():
    placements = [_rank(0), dataclasses.replace(_rank(1), requested="cuda_ipc")]
    with pytest.raises(ValueError, match=SETTING):
        choose(placements)


def test_an_unknown_setting_is_an_error(monkeypatch):
    from megatron_mok.comm.placement import requested_memory

    monkeypatch.setenv(SETTING, "nvshmem")
    with pytest.raises(ValueError, match=SETTING):
        requested_memory()
