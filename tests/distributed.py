"""Runs a test body in N processes joined by gloo (or NCCL for GPU tests), torch.multiprocessing spawn."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import traceback
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, store_path: str, body: Callable, args: tuple, errors, backend: str = "gloo") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    passed = False
    try:
        # A file rendezvous: no TCP port to pick and race for between back-to-back tests.
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        body(rank, world_size, *args)
        dist.barrier()  # no rank leaves while a peer still talks to it
        passed = True
    except BaseException:  # report every rank's failure to the parent
        errors.put((rank, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave without tearing gloo down: its C++ threads have aborted interpreter shutdown after
        # fully successful runs ("terminate called without an active exception", exit -6).
        os._exit(0 if passed else 1)


def run_distributed(body: Callable, world_size: int, *args, backend: str = "gloo") -> None:
    """Runs body(rank, world_size, *args) in `world_size` processes (one node: LOCAL_WORLD_SIZE =
    world_size; with backend "nccl", process r on GPU r); raises the first failure.

    `body` must be a module-level function (it is pickled into the workers).
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    store_dir = tempfile.mkdtemp(prefix="mok_gloo_")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, store_path, body, args, errors, backend))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=600)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    shutil.rmtree(store_dir, ignore_errors=True)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        # A rank that crashes makes its peers fail with "connection closed": show every trace.
        report = "\n".join(f"--- rank {rank} of {world_size} failed:\n{trace}" for rank, trace in sorted(failures))
        raise AssertionError(report)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"worker exit codes {[p.exitcode for p in procs]} (timeout or crash)")
