"""The ranks of a torchrun launch, for the multi-GPU benchmarks (bench_nvlink.py, bench_ep.py).

Rank r drives GPU LOCAL_RANK % (visible GPUs): on a node, one GPU per rank; on one GPU, every rank on
it (the in-kernel exchange then maps the regions by CUDA IPC, comm/placement.py: a check of the code
path, not a measurement). Host collectives go over gloo; NCCL is set up only where asked for (a
baseline's all-to-all), and NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def start(nccl: bool = False, timeout_s: float = 300) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's GPU) after joining torchrun's process group: gloo for CPU
    tensors, and NCCL for CUDA tensors when `nccl`. NVLink multicast stays off."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if nccl else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def shares_gpus() -> bool:
    return dist.get_world_size() > torch.cuda.device_count()


def max_over_ranks(values: list[float]) -> list[float]:
    """Elementwise maximum of every rank's `values` (a host all-reduce over gloo)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def timed_ms(fn, warmup: int, reps: int) -> float:
    """Median ms of fn() on this rank's stream (CUDA events), the ranks lined up by a host barrier
    before every rep, so each rep meets the others' traffic on the links."""
    import statistics

    samples = []
    for i in range(warmup + reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)
