"""Runs a test body in N processes joined by gloo (or NCCL for GPU tests), torch.multiprocessing spawn.

`run_distributed` is for bodies every rank of which must pass; `spawn_ranks` returns what each rank
did (returned, raised, or was still running at the deadline and killed, with its Python stacks while
it ran late), for tests in which ranks fail on purpose and for scripts that report per rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
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


# A rank still alive this long after every rank has reported is stuck on its way out (e.g. in the
# teardown of its CUDA context): it is killed then, not at the deadline, and named on stderr.
EXIT_GRACE_S = 30
# How long to wait for a killed rank to be reaped: a process in uninterruptible sleep (inside a
# driver call) ignores SIGKILL until the call returns, and an unbounded join would hang the test.
KILL_WAIT_S = 10

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
    exitcode: Optional[int]  # None: killed (still running at the deadline, or stuck on its way out)
    result: object = None  # what the body returned, if it returned
    error: Optional[str] = None  # the body's traceback, if it raised
    stacks: str = ""  # the rank's Python stacks while it ran late (spawn_ranks' stack_every_s), if any

    @property
    def returned(self) -> bool:
        return self.error is None and self.exitcode == 0


# The stack file a worker's faulthandler writes to; referenced here so it stays open for the
# process's life.
_STACK_FILE = None


def _worker(
    rank: int, world_size: int, store_path: str, body: Callable, args: tuple, outcomes, backend: str,
    env: dict, barrier_at_end: bool, timeout_s: float, stack_path: str, stack_every_s: float,
) -> None:
    global _STACK_FILE
    # faulthandler's timer is a C thread: it writes the stacks even while the main thread is inside a
    # driver call or holds the GIL. A crash in native code writes its stack there too.
    _STACK_FILE = open(stack_path, "w")
    faulthandler.enable(file=_STACK_FILE)
    faulthandler.dump_traceback_later(stack_every_s, repeat=True, file=_STACK_FILE)
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
        _stop_children()
        # Leave without tearing gloo down: its C++ threads have aborted interpreter shutdown after
        # fully successful runs ("terminate called without an active exception", exit -6).
        os._exit(0 if passed else 1)


def _stop_children(wait_s: float = 5.0) -> None:
    """Stops the processes this rank started through multiprocessing (e.g. the Manager server behind
    Megatron's checkpoint writer's results queue): os._exit skips the atexit handler that would, and
    they would outlive the test, reparented to init, each holding a Python with torch imported."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + wait_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()


def spawn_ranks(
    body: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 600,
    env: Optional[dict] = None, barrier_at_end: bool = False, stack_every_s: Optional[float] = None,
) -> list[RankOutcome]:
    """Runs body(rank, world_size, *args) in `world_size` spawned processes (one node:
    LOCAL_WORLD_SIZE = world_size; with backend "nccl", process r on GPU r; `env` set in each
    before its body) and returns every rank's RankOutcome, in rank order. A process still running
    `timeout_s` after the start, or EXIT_GRACE_S after every rank has reported, is killed (exitcode
    None): nothing a test starts can hang it. The process group's own timeout is timeout_s too.

    Every `stack_every_s` (default timeout_s / 4) a rank that is still running writes its Python
    stacks (faulthandler), which are relayed to stderr as they come, each line under "[rank r of
    R]", and kept in its RankOutcome.stacks: a hang shows where each rank waits, even when the run
    around the test is cut short before the deadline. At the deadline each rank still running is
    named on stderr with its process state (/proc: uninterruptible sleep, the kernel function it
    waits in).

    `body` must be a module-level function (it is pickled into the workers), its result picklable.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    store_dir = tempfile.mkdtemp(prefix="mok_gloo_")
    store_path = os.path.join(store_dir, "store")
    stack_paths = [os.path.join(store_dir, f"stacks.{rank}") for rank in range(world_size)]
    stack_every_s = timeout_s / 4 if stack_every_s is None else stack_every_s
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, store_path, body, args, queue, backend, dict(env or {}), barrier_at_end, timeout_s,
                  stack_paths[rank], stack_every_s),
        )
        for rank in range(world_size)
    ]
    start = time.monotonic()
    for proc in procs:
        proc.start()
    reports: dict[int, tuple] = {}
    stacks = _StackRelay(stack_paths, stack_every_s)

    def drain() -> None:
        # Read while the ranks run: a report larger than the pipe's buffer would block its writer.
        while not queue.empty():
            rank, result, error = queue.get()
            reports[rank] = (result, error)

    deadline = start + timeout_s
    all_reported_at = None
    while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
        drain()
        stacks.relay()
        if all_reported_at is None and len(reports) == world_size:
            all_reported_at = time.monotonic()
        if all_reported_at is not None and time.monotonic() - all_reported_at > EXIT_GRACE_S:
            break
        time.sleep(0.05)
    drain()
    stacks.relay()
    killed = set()
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            state = "reported, then did not exit" if rank in reports else "no report"
            print(f"spawn_ranks: rank {rank} of {world_size} still running {time.monotonic() - start:.0f} s after the "
                  f"start ({state}; {_process_state(proc.pid)}): killed", file=sys.stderr, flush=True)
            proc.kill()
            killed.add(rank)
    for rank, proc in enumerate(procs):
        proc.join(KILL_WAIT_S if rank in killed else None)
        if proc.is_alive():
            print(f"spawn_ranks: rank {rank} of {world_size} did not die within {KILL_WAIT_S} s of SIGKILL "
                  f"({_process_state(proc.pid)}): left behind", file=sys.stderr, flush=True)
    drain()
    stacks.relay()
    shutil.rmtree(store_dir, ignore_errors=True)
    outcomes = []
    for rank, proc in enumerate(procs):
        result, error = reports.get(rank, (None, None))
        exitcode = None if rank in killed else proc.exitcode
        outcomes.append(RankOutcome(rank, exitcode, result, error, stacks.text[rank]))
    return outcomes


class _StackRelay:
    """Copies what the workers' faulthandlers write (one file per rank) to stderr, whole lines, each
    under its rank's name, as it appears; keeps each rank's text."""

    def __init__(self, paths: list[str], every_s: float):
        self.paths, self.every_s = paths, every_s
        self.read = [0] * len(paths)
        self.text = [""] * len(paths)
        self.announced = False

    def relay(self) -> None:
        world_size = len(self.paths)
        for rank, path in enumerate(self.paths):
            try:
                if os.path.getsize(path) <= self.read[rank]:
                    continue
                with open(path, "rb") as file:
                    file.seek(self.read[rank])
                    new = file.read()
            except OSError:  # not created yet
                continue
            whole = new[: new.rfind(b"\n") + 1]  # a line still being written waits for its end
            if not whole:
                continue
            self.read[rank] += len(whole)
            text = whole.decode(errors="replace")
            self.text[rank] += text
            if not self.announced:
                self.announced = True
                print(f"spawn_ranks: what the ranks' faulthandlers wrote (the Python stacks of a rank still "
                      f"running, every {self.every_s:.0f} s, or of a crash):", file=sys.stderr)
            for line in text.splitlines():
                print(f"[rank {rank} of {world_size}] {line}", file=sys.stderr)
            sys.stderr.flush()


def _process_state(pid: Optional[int]) -> str:
    """The process's state and the kernel function it sleeps in, from /proc (Linux), for the line
    that names a rank still running at the deadline."""
    parts = []
    try:
        with open(f"/proc/{pid}/status") as status:
            parts += [line.split(":", 1)[1].strip() for line in status if line.startswith("State:")]
        with open(f"/proc/{pid}/wchan") as wchan:
            parts.append(f"waiting in {wchan.read().strip() or '?'}")
    except OSError:
        pass
    return ", ".join(parts) or "no /proc entry"


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
            f"deadline):\n{o.error or ''}" + (f"\nits stacks while it ran late:\n{o.stacks}" if o.stacks else "")
            for o in failures
        )
        raise AssertionError(report)
