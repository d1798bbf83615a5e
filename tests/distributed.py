"""Runs a test body in N processes joined by gloo (or NCCL for GPU tests), torch.multiprocessing spawn.

`run_distributed` is for bodies every rank of which must pass; `spawn_ranks` returns what each rank
did (returned, raised, or was still running at the deadline and killed), for tests in which ranks
fail on purpose and for scripts that report per rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

import torch.distributed as dist
import torch.multiprocessing as mp


# The environment of GPU ranks, as a launch sets it: CUDA's default lazy module loading (the test
# run sets EAGER for the in-process emulation, tests/conftest.py), NVLink multicast off.
GPU_RANK_ENV = {"CUDA_MODULE_LOADING": "LAZY", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class RankOutcome:
    rank: int
    exitcode: Optional[int]  # None: still running at the deadline (then killed)
    result: object = None  # what the body returned, if it returned
    error: Optional[str] = None  # the body's traceback, if it raised

    @property
    def returned(self) -> bool:
        return self.error is None and self.exitcode == 0


def _worker(
    rank: int, world_size: int, store_path: str, body: Callable, args: tuple, outcomes, backend: str,
    env: dict, barrier_at_end: bool, timeout_s: float,
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.environ.update(env)  # before anything starts CUDA in this process
    passed = False
    try:
        # A file rendezvous: no TCP port to pick and race for between back-to-back tests.
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = body(rank, world_size, *args)
        if barrier_at_end:
            dist.barrier()  # no rank leaves while a peer still talks to it
        outcomes.put((rank, result, None))
        passed = True
    except BaseException:  # report every rank's failure to the parent
        outcomes.put((rank, None, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave without tearing gloo down: its C++ threads have aborted interpreter shutdown after
        # fully successful runs ("terminate called without an active exception", exit -6).
        os._exit(0 if passed else 1)


def spawn_ranks(
    body: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 600,
    env: Optional[dict] = None, barrier_at_end: bool = False,
) -> list[RankOutcome]:
    """Runs body(rank, world_size, *args) in `world_size` spawned processes (one node:
    LOCAL_WORLD_SIZE = world_size; with backend "nccl", process r on GPU r; `env` set in each
    before its body) and returns every rank's RankOutcome, in rank order. A process still running
    `timeout_s` after the start is killed (exitcode None): nothing a test starts can hang it. The
    process group's own timeout is timeout_s too.

    `body` must be a module-level function (it is pickled into the workers), its result picklable.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    store_dir = tempfile.mkdtemp(prefix="mok_gloo_")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, store_path, body, args, queue, backend, dict(env or {}), barrier_at_end, timeout_s),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    reports: dict[int, tuple] = {}

    def drain() -> None:
        # Read while the ranks run: a report larger than the pipe's buffer would block its writer.
        while not queue.empty():
            rank, result, error = queue.get()
            reports[rank] = (result, error)

    deadline = time.monotonic() + timeout_s
    while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
        drain()
        time.sleep(0.05)
    killed = set()
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            proc.kill()
            killed.add(rank)
        proc.join()
    drain()
    shutil.rmtree(store_dir, ignore_errors=True)
    outcomes = []
    for rank, proc in enumerate(procs):
        result, error = reports.get(rank, (None, None))
        outcomes.append(RankOutcome(rank, None if rank in killed else proc.exitcode, result, error))
    return outcomes


def run_distributed(body: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 600) -> list[object]:
    """Runs body(rank, world_size, *args) in `world_size` processes (spawn_ranks; every rank waits
    for the others at the end) and returns the ranks' results; raises the failures of every rank.

    `body` must be a module-level function (it is pickled into the workers).
    """
    outcomes = spawn_ranks(body, world_size, *args, backend=backend, timeout_s=timeout_s, barrier_at_end=True)
    assert_every_rank_returned(outcomes)
    return [outcome.result for outcome in outcomes]


def assert_every_rank_returned(outcomes: list[RankOutcome]) -> None:
    failures = [o for o in outcomes if not o.returned]
    if failures:
        # A rank that crashes makes its peers fail with "connection closed": show every trace.
        world_size = len(outcomes)
        report = "\n".join(
            f"--- rank {o.rank} of {world_size} failed (exit code {o.exitcode}; None: still running at the "
            f"deadline):\n{o.error or ''}"
            for o in failures
        )
        raise AssertionError(report)
