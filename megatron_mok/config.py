"""The frozen configuration of a MoK layer call."""

from __future__ import annotations

import dataclasses
from typing import Literal

from typing import Optional

from megatron_mok.backends.tuning import EXPERT_GEMM_CHOICES, EXPERT_GEMM_GROUP_M
from megatron_mok.limits import min_dispatch_ring_minibatches
from megatron_mok.quantization import Fp8Recipe

Backend = Literal["auto", "reference", "kernel"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "kernel")
ExpertGemm = Literal["auto", "grouped_mm", "sm90"]
ExchangeKind = Literal["auto", "collective", "symmetric"]
EXCHANGES: tuple[str, ...] = ("auto", "collective", "symmetric")
EXPERT_GEMMS: tuple[str, ...] = tuple(EXPERT_GEMM_CHOICES)
Precision = Literal["bf16", "fp8_blockwise"]
PRECISIONS: tuple[str, ...] = ("bf16", "fp8_blockwise")
# The shortest ring the dispatching GEMM accepts at the raster the kernel backend runs (the op checks
# the same bound for the group_m it is given).
MIN_DISPATCH_RING_MINIBATCHES = min_dispatch_ring_minibatches(EXPERT_GEMM_GROUP_M)


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """How `mok_moe` and the functional layer run.

    Attributes:
        backend: "reference" runs the exact PyTorch implementation; "kernel" the CUDA kernel
            backend for Hopper (an error where it cannot run, see backends/__init__.py); "auto" picks the
            kernel where it can run and the reference elsewhere.
        segment_alignment: every local expert's segment of the schedule is padded to a
            multiple of this many rows (padding rows are marked -1). Results do not depend on it:
            both backends take segments of any length; 1 (the default) adds no padding rows.
        expert_gemm: which GEMMs run the kernel backend's expert projections, forward and
            backward: "grouped_mm", the dispatch kernel, torch's grouped GEMM (CUTLASS) and the
            SwiGLU kernels; "sm90", megatron_mok's persistent warp-specialized TMA + wgmma
            kernels (csrc/gemm/): gate/up with the
            dispatch inside (handed over minibatch by minibatch) and SwiGLU in its epilogue, down,
            the dgrads reading the weights as stored (SwiGLU backward in the down dgrad's
            epilogue) and the weight gradients; "auto" (the default), per projection the one
            measured faster on the H200 (backends/tuning.py EXPERT_GEMM_CHOICES,
            docs/performance.md). All give results within the same bound, bitwise reproducible.
        dispatch_ring_minibatches: the kernel backend's in-kernel dispatch (the "sm90" gate/up
            GEMM) writes the dispatched rows into a ring of this many minibatches of
            limits.DISPATCH_MINIBATCH_ROWS rows, reused once every GEMM tile has loaded a slot, so
            that buffer is bounded whatever the routing (all tokens to one expert included); the
            weight gradient of fc1 then gathers the rows again in backward. 0: no bound, the rows
            (capacity, hidden) are kept from forward to backward. Otherwise at least
            MIN_DISPATCH_RING_MINIBATCHES (one more than the minibatches a raster group of the
            GEMM's tiles spans, so the dispatch never waits on itself).
        exchange: how rows cross expert-parallel ranks (megatron_mok/comm/): "collective",
            torch.distributed all-gathers and all-to-alls (any device, any EP size; EP times the
            rows of a balanced routing on every rank); "symmetric", the in-kernel exchange through
            symmetric memory (pull dispatch, push combine, device-side signals; CUDA ranks of one
            node with peer access, or processes sharing one GPU, and the extension on every rank;
            an error elsewhere); "auto" (the default): "symmetric" wherever the group offers it
            (megatron_mok.emulation's ranks; a process group whose ranks can share symmetric
            memory, comm/placement.py), else "collective", with a one-time line saying which and why.
        receive_capacity_factor: the receive capacity of a rank over the in-kernel exchange, in
            units of its own T*K routes: a pass runs over its schedule in windows of about this
            many times T*K rows (plus the segments' padding; megatron_mok/receive.py), each a
            macrobatch through the same stages, so the expert stages' memory is set by the window,
            not by EP times the tokens, whatever the routing. Routings that send a rank more rows
            run more (fixed-count, mostly empty) windows and recompute their gate/up in backward;
            with the sm90 weight gradients (`expert_gemm` "auto" and "sm90") results are bitwise the
            same for any factor; the other families sum the windows' weight-gradient partials in
            fp32 (equal up to rounding). 1.0 (the default): a balanced routing
            fits one window, and memory matches EP = 1's (docs/performance.md, EP memory). The
            collective exchange runs one window of the whole schedule.
        precision: the routed experts' GEMMs. "bf16" (the default): in the activation dtype (bf16,
            or fp32 for fp32 inputs) with fp32 accumulation. "fp8_blockwise": DeepSeek-V3's recipe
            (docs/design.md §12): E4M3 operands, 1x128 scales for activations and their gradients
            (x quantized once where a rank publishes it, so the rows the exchange moves are FP8),
            128x128 for the weights (quantized once per weight version, megatron_mok/fp8_weights.py),
            accumulation promoted to fp32 every 128 of K; router, combine and everything outside
            the routed experts' GEMMs stay in the activation dtype / fp32. Needs hidden and ffn_hidden
            multiples of 128 (a ValueError naming the argument otherwise). The kernel backend runs it
            on Hopper ("auto" picks it where it picks the BF16 kernels), the reference backend
            anywhere (CPU too). Either exchange moves the FP8 rows and their scales (half the bytes
            of bf16 rows); "auto" chooses as for bf16.
        fp8_weight_grad: with fp8_blockwise, the expert weight gradients in FP8 (both operands
            quantized 1x128 along tokens from the high-precision values); False: in the activation
            dtype, as with bf16.
        fp8_pow2_scales: with fp8_blockwise, every scale a quantization makes rounded up to a power
            of two (the down dgrad's rows w * dY carry dY's scale times the route weight w, which
            is not one: docs/design.md §12.4).
        fp8_cache_weights: with fp8_blockwise, each expert weight's forward FP8 copy (half the
            weight's bf16 bytes) is kept from one forward to the next until the weight changes, so
            the microbatches of one optimizer step quantize it once (True, the default); False
            quantizes it in every forward (once for all of a pass's receive windows) and frees it
            after the pass: no FP8 copy is held between passes, which brings the layer's peak memory
            to about the BF16 layer's (docs/performance.md: below it at DeepSeek-V3's shape, 0.25%
            above at Qwen3-30B's), for one weight quantization more per microbatch.
        fp8_cache_transposed_weights: with fp8_blockwise and fp8_cache_weights, the kernel backend
            keeps each expert weight's transposed FP8 copy (the dgrads' operand: sm90's FP8 wgmma
            reads K-major operands only) beside the forward copy until the weight changes, made in
            the same pass as the forward copy, so that no backward makes it again (True); False,
            the default, makes it in every backward, range of experts by range, each range freed
            after its dgrad: the cache then holds half the weight's bf16 bytes, not all of them.
        check_expert_ids: validate that every expert id lies in [-1, num_experts). On CPU
            tensors a bad id raises ValueError; on CUDA a host-side check would synchronize, so
            the schedule kernel checks the ids as it reads them and traps on a bad one
            (`ops.last_failure()` and a message at exit name it; without the extension, a
            `torch._assert_async` device-side assert).
    """

    backend: Backend = "auto"
    segment_alignment: int = 1
    check_expert_ids: bool = True
    expert_gemm: ExpertGemm = "auto"
    dispatch_ring_minibatches: int = 16
    exchange: ExchangeKind = "auto"
    receive_capacity_factor: float = 1.0
    precision: Precision = "bf16"
    fp8_weight_grad: bool = True
    fp8_pow2_scales: bool = False
    fp8_cache_weights: bool = True
    fp8_cache_transposed_weights: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"MoKConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.expert_gemm not in EXPERT_GEMMS:
            raise ValueError(f"MoKConfig.expert_gemm must be one of {EXPERT_GEMMS}, got {self.expert_gemm!r}")
        ring = self.dispatch_ring_minibatches
        if not isinstance(ring, int) or isinstance(ring, bool) or not (ring == 0 or ring >= MIN_DISPATCH_RING_MINIBATCHES):
            raise ValueError(
                f"MoKConfig.dispatch_ring_minibatches must be 0 (no bound) or an int >= "
                f"{MIN_DISPATCH_RING_MINIBATCHES}, got {ring!r}"
            )
        if self.exchange not in EXCHANGES:
            raise ValueError(f"MoKConfig.exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        factor = self.receive_capacity_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (0 < factor < float("inf")):
            raise ValueError(f"MoKConfig.receive_capacity_factor must be a positive finite number, got {factor!r}")
        if not isinstance(self.segment_alignment, int) or self.segment_alignment < 1:
            raise ValueError(
                f"MoKConfig.segment_alignment must be a positive int, got {self.segment_alignment!r}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"MoKConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        for name in ("fp8_weight_grad", "fp8_pow2_scales", "fp8_cache_weights", "fp8_cache_transposed_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoKConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.fp8_cache_transposed_weights and not self.fp8_cache_weights:
            raise ValueError("MoKConfig.fp8_cache_transposed_weights=True needs fp8_cache_weights=True (the "
                             "transposed copies are kept beside the cached forward copies)")

    def fp8_recipe(self) -> Optional[Fp8Recipe]:
        """The FP8 recipe a call runs, None for bf16."""
        if self.precision != "fp8_blockwise":
            return None
        return Fp8Recipe(
            pow2_scales=self.fp8_pow2_scales, weight_grad=self.fp8_weight_grad, cache_weights=self.fp8_cache_weights,
            cache_transposed_weights=self.fp8_cache_transposed_weights,
        )
