"""R expert-parallel ranks in one process, on one device: the whole EP protocol without a cluster.

    group = EmulatedGroup(num_ranks=4, device="cuda")       # device="cpu": the reference backend
    ys = group.mok_moe(xs, topk_ids, topk_weights, fc1s, fc2s, config=MoKConfig())  # one per rank

Each emulated rank has its own tensors and buffers and its own CUDA stream. Two exchanges:

- `exchange="symmetric"` (the default on CUDA): the in-kernel exchange (comm/symmetric_exchange.py).
  Each rank's regions are separate allocations and the peer tables point at them, as torch symmetric
  memory gives one per GPU. The ranks' passes are launched one after the other from this thread,
  each on its own stream; they meet on the device (bounded signal waits), so nothing blocks the host
  and a whole step of every rank can be captured in one CUDA graph (fork the ranks' streams from the
  capture stream). Every line of the layer a real rank runs, an emulated rank runs, kernels included.
- `exchange="collective"` (the only one on CPU): the collective exchange, whose all-gathers and
  all-to-alls an in-process rendezvous implements (`EmulatedRankGroup.all_gather` / `all_to_all`);
  each rank runs in its own host thread and meets the others there. Every rendezvous is bounded
  (`timeout_s`): a rank that never arrives (or fails) is an error naming the waiting rank and the
  collective, never a hang. Not capturable (the rendezvous is on the host).

With `MoKConfig(precision="fp8_blockwise")` the symmetric form moves FP8 rows through the ranks'
FP8 regions, the collective form gathers them; "auto" chooses as for bf16.

Either way rank r's outputs and gradients are bitwise those of a real group's rank r. With the
symmetric exchange every rank's y must take part in the backward (as on a real group, where every
rank runs its backward): a rank whose backward never runs leaves the others waiting, and their
bounded waits trap. The collective form runs every rank's backward in one node, with zeros for an
unused y.
`mok_moe` here takes no shared expert (it is rank-local: add it per rank).

The symmetric form needs CUDA's eager module loading (CUDA_MODULE_LOADING=EAGER, set before CUDA
starts; EmulatedGroup sets it itself when CUDA has not started yet): a rank's kernel spins until a
rank launched after it signals, and under lazy loading the first launch of a kernel may wait for
the whole device to be idle — for the spinning kernel, which waits for that launch (CUDA
programming guide, lazy loading, "concurrent execution"). Real ranks are one process per GPU, where
no kernel waits on a launch of its own process, so only the emulation needs it.

For the same reason a pass's launches must not outnumber what its stream can queue: a rank whose
kernel waits for a rank launched after it keeps every later launch of its pass queued behind that
kernel until the peer's launch arrives, and CUDA's queue of pending launches is finite: once full, the
next launch blocks this thread, the peer's launch never comes, and the waiting kernel's bounded wait
traps. The kernel backend launches a few kernels per stage; the reference backend launches many
small ones (quantization.py batches its FP8 GEMMs' block products for this), so the reference over the
symmetric form is the case to keep small. Real ranks launch from their own processes and never block
one another so.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Optional, Sequence

import torch

from megatron_mok import functional
from megatron_mok.comm.group import ExpertParallelGroup
from megatron_mok.comm.symmetric import SymmetricPool, emulated_allocator
from megatron_mok.config import MoKConfig
from megatron_mok.limits import MAX_EP_RANKS, NUM_EXCHANGE_PHASES
from megatron_mok.validation import validate_moe_inputs


def require_eager_module_loading() -> None:
    """Makes sure CUDA loads every kernel when it starts (the module docstring says why): sets
    CUDA_MODULE_LOADING=EAGER when CUDA has not started, else raises unless it is set."""
    mode = os.environ.get("CUDA_MODULE_LOADING")
    if mode == "EAGER":
        return
    if mode is None and not torch.cuda.is_initialized():
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
        return
    raise RuntimeError(
        "EmulatedGroup(exchange='symmetric') needs CUDA_MODULE_LOADING=EAGER in the environment before "
        f"CUDA starts (it is {mode!r}, CUDA started={torch.cuda.is_initialized()}): emulated ranks' kernels wait for "
        "kernels launched after them, and lazy module loading can wait for the device to be idle, a deadlock"
    )


class EmulatedRankTimeout(RuntimeError):
    """A rank of an EmulatedGroup waited past the group's timeout at a collective."""


class _Rendezvous:
    """Every rank hands in one value and gets every rank's values, in rank order."""

    def __init__(self, num_ranks: int, timeout_s: float):
        self.slots: list[object] = [None] * num_ranks
        self.barrier = threading.Barrier(num_ranks, timeout=timeout_s)
        self.timeout_s = timeout_s

    def exchange(self, rank: int, value: object, what: str) -> list[object]:
        self.slots[rank] = value
        self._wait(rank, what, "arrive")
        values = list(self.slots)
        self._wait(rank, what, "leave")  # no rank overwrites a slot before every rank has read it
        return values

    def _wait(self, rank: int, what: str, phase: str) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise EmulatedRankTimeout(
                f"emulated rank {rank}: {what} ({phase}): not every rank of the group arrived within "
                f"{self.timeout_s:g} s (a rank failed, or never called)"
            ) from None


class EmulatedRankGroup(ExpertParallelGroup):
    """One emulated rank: an ExpertParallelGroup whose collectives meet the other ranks in-process."""

    def __init__(self, rank: int, num_ranks: int, device: torch.device, rendezvous: _Rendezvous, make_pool=None):
        super().__init__(group=None, rank=rank, num_ranks=num_ranks, device=device)
        self.rendezvous = rendezvous
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._make_pool = make_pool  # None: the collective exchange

    def symmetric_pool(self):
        if self._make_pool is None:
            return None, "this EmulatedGroup runs the collective exchange"
        if self._pool is None:
            self._pool = self._make_pool(self.rank)
        return self._pool, ""

    def _gather_objects(self, value: object) -> list[object]:
        if self._make_pool is not None:
            # The symmetric form launches its ranks one after the other from one thread, so a host
            # rendezvous here would wait for a rank not launched yet: EmulatedGroup.mok_moe checks
            # every rank's shapes itself before launching any.
            return [value] * self.num_ranks
        return self.rendezvous.exchange(self.rank, value, "shape agreement")

    def _gathered(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        values = self.rendezvous.exchange(self.rank, (tensor, event), what)
        if self.stream is None:
            return [t for t, _ in values]
        stream = torch.cuda.current_stream(self.device)
        for peer_tensor, peer_event in values:
            stream.wait_event(peer_event)  # the peer's stream wrote it
            peer_tensor.record_stream(stream)  # not reused by the peer's allocator while we read it
        return [t for t, _ in values]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._gathered(tensor, "all_gather"))

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        if send.shape[0] != self.num_ranks:
            raise ValueError(f"all_to_all needs a leading dim of {self.num_ranks}, got {send.shape}")
        sends = self._gathered(send, "all_to_all")
        return torch.stack([peer_send[self.rank] for peer_send in sends])


def _start_blas(stream: torch.cuda.Stream) -> None:
    """Creates this thread's cuBLAS and cuBLASLt handles and their workspaces for `stream` (torch does it
    lazily at a stream's first matmul, and creating a handle can wait for the device to be idle: in a
    pass launched behind a rank's signal wait that is a deadlock until the wait's bound traps). The
    reference stages' matmuls (bf16, fp32, and the FP8 recipe's exact float64 block products) then
    find them made, and cuBLAS's kernels of each dtype loaded (loading a module waits for the device
    too)."""
    with torch.cuda.stream(stream):
        torch.cuda.current_blas_handle()
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            for size in (8, 128):
                a = torch.ones(2, size, size, dtype=dtype, device=stream.device)
                torch.bmm(a, a)
                torch.mm(a[0], a[0])
                torch.addmm(a[0], a[0], a[0])


class EmulatedGroup:
    """R emulated expert-parallel ranks on one device (see the module docstring)."""

    def __init__(
        self, num_ranks: int, device: str | torch.device = "cuda", *, exchange: Optional[str] = None, timeout_s: float = 60.0
    ):
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        self.num_ranks = num_ranks
        self.device = torch.device(device)
        symmetric = (exchange or ("symmetric" if self.device.type == "cuda" else "collective")) == "symmetric"
        if symmetric and self.device.type == "cuda":
            require_eager_module_loading()  # before the device index below starts CUDA
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.exchange = exchange or ("symmetric" if self.device.type == "cuda" else "collective")
        if self.exchange not in ("symmetric", "collective"):
            raise ValueError(f"exchange must be 'symmetric' or 'collective', got {self.exchange!r}")
        make_pool = None
        if self.exchange == "symmetric":
            if self.device.type != "cuda":
                raise ValueError("exchange='symmetric' needs a CUDA device (its kernels read peer buffers)")
            if num_ranks > MAX_EP_RANKS:
                raise ValueError(f"exchange='symmetric' addresses at most {MAX_EP_RANKS} ranks (one node), got {num_ranks}")
            make_pool = self._make_pool
            self._allocators = emulated_allocator(num_ranks, self.device)
        self.rendezvous = _Rendezvous(num_ranks, timeout_s)
        self.ranks = [EmulatedRankGroup(r, num_ranks, self.device, self.rendezvous, make_pool) for r in range(num_ranks)]

    def _make_pool(self, rank: int) -> SymmetricPool:
        from megatron_mok import ops

        if ops.extension_error() is not None:
            raise RuntimeError(f"exchange='symmetric' needs the CUDA extension: {ops.extension_error()}")
        return SymmetricPool(rank, self.num_ranks, NUM_EXCHANGE_PHASES, self._allocators(rank), self.device)

    def prepare(self, num_tokens: int, hidden: int, topk: int, dtype: torch.dtype, fp8: bool = False) -> None:
        """Creates every rank's symmetric pool and the regions of one layer-call shape (with fp8, the
        FP8 recipe's too), before any rank's pass is launched: afterwards nothing in a pass allocates
        or waits on the host."""
        for rank_group in self.ranks:
            pool, reason = rank_group.symmetric_pool()
            if pool is None:
                raise RuntimeError(f"emulated rank {rank_group.rank}: {reason}")
            pool.prepare(num_tokens, hidden, topk, dtype, fp8)
            _start_blas(rank_group.stream)

    def run_launched(self, body: Callable[[int], object], ranks: Optional[Sequence[int]] = None) -> list[object]:
        """Runs body(rank) for every rank (or only `ranks`) from this thread, one after the other, each
        on its own stream forked from the current one and joined back: for work that waits on the
        device only (the symmetric exchange), so the ranks meet on the GPU. Capturable in a CUDA graph."""
        ranks = list(range(self.num_ranks)) if ranks is None else list(ranks)
        main_stream = torch.cuda.current_stream(self.device)
        results: list[object] = [None] * self.num_ranks
        for rank in ranks:
            stream = self.ranks[rank].stream
            stream.wait_stream(main_stream)
            with torch.cuda.stream(stream):
                results[rank] = body(rank)
        self._join(main_stream, ranks, results)
        return results

    def _join(self, main_stream, ranks: Sequence[int], results: list[object]) -> None:
        """The caller's stream waits for the ranks' streams, and their results are not reused by the
        allocator while the caller's stream may still read them."""
        for rank in ranks:
            main_stream.wait_stream(self.ranks[rank].stream)
        for result in results:
            for tensor in _tensors_in(result):
                tensor.record_stream(main_stream)

    def run(self, body: Callable[[int], object], ranks: Optional[Sequence[int]] = None) -> list[object]:
        """Runs body(rank) for every rank (or only `ranks`, e.g. to test a rank that never arrives),
        each in its own thread and on its own stream, and returns the results in rank order. The
        first failure is raised after every thread ended (the others fail at their next collective)."""
        ranks = list(range(self.num_ranks)) if ranks is None else list(ranks)
        results: list[object] = [None] * self.num_ranks
        errors: list[tuple[int, BaseException]] = []
        main_stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def worker(rank: int) -> None:
            group = self.ranks[rank]
            try:
                if main_stream is None:
                    results[rank] = body(rank)
                    return
                with torch.cuda.device(self.device):
                    group.stream.wait_stream(main_stream)  # the inputs were made on the caller's stream
                    with torch.cuda.stream(group.stream):
                        results[rank] = body(rank)
            except BaseException as error:  # noqa: BLE001 (re-raised below)
                errors.append((rank, error))
                self.rendezvous.barrier.abort()  # the others fail at their next collective, not hang

        threads = [threading.Thread(target=worker, args=(r,), name=f"mok-emulated-rank-{r}") for r in ranks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if main_stream is not None:
            self._join(main_stream, ranks, results)
        if errors:
            self.rendezvous.barrier.reset()
            # A rank's own error first: the others only report that it never arrived.
            errors.sort(key=lambda item: isinstance(item[1], EmulatedRankTimeout))
            rank, error = errors[0]
            raise error
        return results

    def mok_moe(
        self,
        xs: Sequence[torch.Tensor],
        topk_ids: Sequence[torch.Tensor],
        topk_weights: Sequence[torch.Tensor],
        fc1s: Sequence[torch.Tensor],
        fc2s: Sequence[torch.Tensor],
        *,
        config: MoKConfig = MoKConfig(),
    ) -> list[torch.Tensor]:
        """megatron_mok.mok_moe on every rank: lists of R tensors, rank r's arguments at index r (same
        layouts as mok_moe). Returns each rank's y; differentiable in every rank's x, topk_weights,
        fc1 and fc2."""
        inputs = (xs, topk_ids, topk_weights, fc1s, fc2s)
        for name, values in zip(("xs", "topk_ids", "topk_weights", "fc1s", "fc2s"), inputs):
            if not isinstance(values, (list, tuple)) or len(values) != self.num_ranks:
                raise ValueError(f"{name} must be a list of {self.num_ranks} tensors (one per rank)")
        # Every rank of a group passes the same num_tokens, topk and expert shapes.
        for name, values in zip(("xs", "topk_ids", "topk_weights", "fc1s", "fc2s"), inputs):
            shapes = {tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in values}
            if len(shapes) != 1:
                raise ValueError(f"{name}: every rank must pass the same shape, got {[getattr(v, 'shape', v) for v in values]}")
        for rank in range(self.num_ranks):
            validate_moe_inputs(
                xs[rank], topk_ids[rank], topk_weights[rank], fc1s[rank], fc2s[rank],
                num_ranks=self.num_ranks, config=config,
            )
        # FP8 rows (MoKConfig.precision) cross over the symmetric exchange only when the config asks
        # for it by name ("auto" keeps them on the collective one, comm/exchange.py exchange_for):
        # otherwise the ranks run in threads and meet at the in-process rendezvous.
        symmetric = config.exchange == "symmetric" or config.exchange == "auto" and config.precision == "bf16"
        if self.exchange == "symmetric" and symmetric:
            # One autograd node per rank, as on a real group: their backwards meet on the device too,
            # in whatever order autograd runs them. Every rank's regions exist before any rank is
            # launched (comm/symmetric.py, emulated_allocator's NOTES).
            from megatron_mok.moe import mok_moe

            self.prepare(*xs[0].shape, topk_ids[0].shape[1], xs[0].dtype, fp8=config.precision != "bf16")

            return self.run_launched(
                lambda r: mok_moe(xs[r], topk_ids[r], topk_weights[r], fc1s[r], fc2s[r], group=self.ranks[r], config=config)
            )
        flat = [*xs, *topk_ids, *topk_weights, *fc1s, *fc2s]
        return list(_EmulatedRoutedExperts.apply(self, config, *flat))


def _tensors_in(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, functional.ForwardContext):
        return [t for t in value.tensors() if t is not None]
    if isinstance(value, functional.Grads):
        return [t for t in (value.x, value.topk_weights, value.fc1, value.fc2) if t is not None]
    return []


def _zero_grad_y(fctx: functional.ForwardContext) -> torch.Tensor:
    # A rank whose y took no part in the loss still runs its backward: its peers wait for it.
    return torch.zeros_like(fctx.x)


class _EmulatedRoutedExperts(torch.autograd.Function):
    """Every rank's routed experts as one autograd node: forward and backward each run all ranks
    at once, since each rank's pass waits for the others at the exchange."""

    @staticmethod
    def forward(ctx, group: EmulatedGroup, config: MoKConfig, *flat):
        r = group.num_ranks
        xs, ids, ws, fc1s, fc2s = (flat[i * r:(i + 1) * r] for i in range(5))
        results = group.run(
            lambda k: functional.forward(
                xs[k], ids[k], ws[k], fc1s[k], fc2s[k], group=group.ranks[k], config=config, validate=False
            )
        )
        ctx.group = group
        ctx.save_for_backward(*fc1s, *fc2s)
        ctx.fctxs = [fctx for _, fctx in results]
        return tuple(y for y, _ in results)

    @staticmethod
    def backward(ctx, *grad_ys):
        group = ctx.group
        r = group.num_ranks
        saved = ctx.saved_tensors
        fc1s, fc2s = saved[:r], saved[r:]
        needs = ctx.needs_input_grad[2:]
        need_x, need_w, need_fc1, need_fc2 = (any(needs[i * r:(i + 1) * r]) for i in (0, 2, 3, 4))
        # Each rank's activations are held by its context alone; kept under create_graph (grad mode on
        # here: _RoutedExperts.backward says why). Read on this thread: the ranks may run on others.
        release_saved = not torch.is_grad_enabled()
        grads = group.run(
            lambda k: functional.backward(
                ctx.fctxs[k],
                grad_ys[k] if grad_ys[k] is not None else _zero_grad_y(ctx.fctxs[k]),
                fc1s[k],
                fc2s[k],
                need_input_grads=need_x or need_w,
                need_weight_grads=need_fc1 or need_fc2,
                release_saved=release_saved,
            )
        )
        ctx.fctxs = None
        return (
            None,
            None,
            *(g.x for g in grads),
            *([None] * r),
            *(g.topk_weights for g in grads),
            *(g.fc1 for g in grads),
            *(g.fc2 for g in grads),
        )
