"""Sizes and limits that Python and the CUDA kernels must agree on, defined once.

setup.py hands every name in `COMPILED` to nvcc as `-DMOK_<NAME>=<value>` (csrc/common/limits.h
turns them into constants and refuses to compile without them); the loaded extension reports the
values it was built with (`megatron_mok.ops.compiled_limits()`) and a test checks they equal these,
so a stale build cannot disagree silently. This module imports nothing, so setup.py can read it
before torch is importable. Kernel *choices* (cluster sizes, rasters, which GEMM family runs a
projection) are tuning, not limits: megatron_mok/backends/tuning.py.
"""

# Rows per 128-row m-tile of the sm90 expert GEMMs (two consumer warpgroups x 64 rows). A tile
# never straddles a minibatch boundary badly: the ring mirrors one tile past its end.
EXPERT_GEMM_TILE_M = 128

# Columns of B per tile of the sm90 expert GEMMs (one wgmma m64n256): the weight gradient's output
# tiles are EXPERT_GEMM_TILE_M x EXPERT_GEMM_TILE_N, which sizes its carried accumulators.
EXPERT_GEMM_TILE_N = 256
# Rows per K block of the weight-gradient GEMM (tokens are its reduction dimension): its fp32
# accumulators can be carried from one receive window to the next only at a K block of every
# segment, so windowed passes align the segments to this (megatron_mok/receive.py).
EXPERT_WGRAD_K_ROWS = 64

# Rows per minibatch of the dispatching GEMM: the unit in which the dispatch hands rows to the GEMM
# (a ready counter per minibatch) and in which its ring buffer is reused.
DISPATCH_MINIBATCH_ROWS = 1024
# Most minibatches of the dispatching GEMM's ring (MoKConfig.dispatch_ring_minibatches): the ring's
# rows, with the mirrored m-tile past its end, are 32-bit on the device (mok_params.h DispatchRingParams).
MAX_DISPATCH_RING_MINIBATCHES = (1 << 20) - 1

# Largest topk the row gather / combine kernels take (their per-token tables live in shared memory).
MAX_TOPK = 4096

# Every bounded wait of a kernel gives up after this long, records which wait and traps.
WAIT_TIMEOUT_NS = 10 * 1000 * 1000 * 1000

# Most ranks of an expert-parallel group whose buffers the in-kernel exchange addresses (one NVLink
# node): the kernels take the peers' addresses by value in their params.
MAX_EP_RANKS = 8

# FP8 blockwise (docs/design.md §12): the block of values that shares one fp32 scale, 128 along a
# GEMM's reduction dimension (1x128 for activations and their gradients; 128x128 for weights). One
# wgmma E4M3 instruction reduces 32 of K, so a block is four of them, promoted into fp32 together.
FP8_BLOCK = 128
# The E4M3 value a block's largest magnitude is scaled to (E4M3's largest finite value).
FP8_E4M3_MAX = 448
# The GEMM-A scale layout (C/128, R_pad) pads R to this many rows: a TMA global stride must be a
# multiple of 16 bytes (4 fp32).
FP8_SCALE_ROW_PAD = 4
# Phases of the in-kernel exchange's signal protocol (comm/symmetric.py), the first dimension of its
# signal pad; csrc/common/failure_codes.h names them (ops.exchange_phase_names() reads the names).
NUM_EXCHANGE_PHASES = 6

COMPILED = {
    "EXPERT_GEMM_TILE_M": EXPERT_GEMM_TILE_M,
    "EXPERT_GEMM_TILE_N": EXPERT_GEMM_TILE_N,
    "EXPERT_WGRAD_K_ROWS": EXPERT_WGRAD_K_ROWS,
    "DISPATCH_MINIBATCH_ROWS": DISPATCH_MINIBATCH_ROWS,
    "MAX_DISPATCH_RING_MINIBATCHES": MAX_DISPATCH_RING_MINIBATCHES,
    "MAX_TOPK": MAX_TOPK,
    "WAIT_TIMEOUT_NS": WAIT_TIMEOUT_NS,
    "MAX_EP_RANKS": MAX_EP_RANKS,
    "FP8_BLOCK": FP8_BLOCK,
    "FP8_E4M3_MAX": FP8_E4M3_MAX,
    "FP8_SCALE_ROW_PAD": FP8_SCALE_ROW_PAD,
    "NUM_EXCHANGE_PHASES": NUM_EXCHANGE_PHASES,
}


def raster_group_minibatches(group_m: int) -> int:
    """Minibatches one raster group of group_m m-tiles spans (a dispatcher waits on a ring slot only
    after every earlier minibatch is written, so a ring longer than this cannot wait on itself)."""
    return -(-group_m * EXPERT_GEMM_TILE_M // DISPATCH_MINIBATCH_ROWS)


def min_dispatch_ring_minibatches(group_m: int) -> int:
    """The shortest ring (in minibatches) the dispatching GEMM accepts for raster groups of group_m."""
    return raster_group_minibatches(group_m) + 1


def dispatch_ring_holds_every_row(rows: int, ring_minibatches: int) -> bool:
    """Whether a ring of ring_minibatches minibatches (0: unbounded) holds all `rows` rows, so that no
    slot is reused and the dispatched rows survive the GEMM."""
    return ring_minibatches == 0 or ring_minibatches * DISPATCH_MINIBATCH_ROWS >= rows


def dispatch_ring_buffer_rows(rows: int, ring_minibatches: int) -> int:
    """Rows of the dispatching GEMM's row buffer for `rows` schedule rows: `rows` when the ring holds
    every row, else the ring and a mirror of its first m-tile (a tile's TMA box never runs off its end)."""
    if dispatch_ring_holds_every_row(rows, ring_minibatches):
        return rows
    return ring_minibatches * DISPATCH_MINIBATCH_ROWS + EXPERT_GEMM_TILE_M


def schedule_capacity(num_routes: int, num_local_experts: int, segment_alignment: int) -> int:
    """Worst-case rows of a schedule: every route of the group lands here and every segment needs
    full padding (segment_alignment - 1 rows)."""
    return num_routes + num_local_experts * (segment_alignment - 1)


def wgrad_carry_numel(m: int, n: int) -> int:
    """fp32 elements of a carry buffer of ops.expert_gemm_wgrad_window for an (m, n) weight
    gradient: one expert's accumulators, m and n rounded up to whole tiles (m_tiles * n_tiles tiles of
    EXPERT_GEMM_TILE_M * EXPERT_GEMM_TILE_N floats; the layout is in csrc/mok_params.h,
    WgradCarryParams)."""
    m_tiles = -(-m // EXPERT_GEMM_TILE_M)
    n_tiles = -(-n // EXPERT_GEMM_TILE_N)
    return m_tiles * EXPERT_GEMM_TILE_M * n_tiles * EXPERT_GEMM_TILE_N


def fp8_padded_rows(rows: int) -> int:
    """Rows of a column-wise FP8 operand (C, R_pad) for R = rows: R rounded up to a 128-row block."""
    return -(-rows // FP8_BLOCK) * FP8_BLOCK


def fp8_scale_rows(rows: int) -> int:
    """Rows of the GEMM-A scale layout (C/128, R_pad) for R = rows: R rounded up to FP8_SCALE_ROW_PAD."""
    return -(-rows // FP8_SCALE_ROW_PAD) * FP8_SCALE_ROW_PAD
