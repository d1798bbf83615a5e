// The sizes and limits the kernels share with Python, defined once in megatron_mok/limits.py
// (`COMPILED`): setup.py passes each entry to nvcc and the host compiler as -DMOK_<NAME>=<value>,
// and this header turns them into constants, refusing to compile without them. The ops
// compiled_limits / compiled_limit_names report what a build was compiled with, so Python can
// check dict(zip(names, values)) == limits.COMPILED and a stale build cannot disagree silently.
#pragma once

#include <cstdint>

#ifndef MOK_EXPERT_GEMM_TILE_M
#error "MOK_EXPERT_GEMM_TILE_M is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_EXPERT_GEMM_TILE_N
#error "MOK_EXPERT_GEMM_TILE_N is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_EXPERT_WGRAD_K_ROWS
#error "MOK_EXPERT_WGRAD_K_ROWS is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_DISPATCH_MINIBATCH_ROWS
#error "MOK_DISPATCH_MINIBATCH_ROWS is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_MAX_DISPATCH_RING_MINIBATCHES
#error "MOK_MAX_DISPATCH_RING_MINIBATCHES is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_MAX_TOPK
#error "MOK_MAX_TOPK is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_WAIT_TIMEOUT_NS
#error "MOK_WAIT_TIMEOUT_NS is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_MAX_EP_RANKS
#error "MOK_MAX_EP_RANKS is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_FP8_BLOCK
#error "MOK_FP8_BLOCK is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_FP8_E4M3_MAX
#error "MOK_FP8_E4M3_MAX is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_FP8_SCALE_ROW_PAD
#error "MOK_FP8_SCALE_ROW_PAD is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif
#ifndef MOK_NUM_EXCHANGE_PHASES
#error "MOK_NUM_EXCHANGE_PHASES is not defined: build through setup.py, which passes megatron_mok/limits.py COMPILED as -DMOK_<NAME>=<value>"
#endif

namespace mok {

// Rows per m-tile of the sm90 expert GEMMs (gemm/tile_sm90.cuh asserts its Tile::kM equals it).
constexpr int kExpertGemmTileM = MOK_EXPERT_GEMM_TILE_M;
// Columns of B per tile (gemm/tile_sm90.cuh asserts its Tile::kN equals it): with kExpertGemmTileM
// the weight gradient's tile, the unit of its carried accumulators (mok_params.h WgradCarryParams).
constexpr int kExpertGemmTileN = MOK_EXPERT_GEMM_TILE_N;
// Rows per K block of the weight-gradient GEMM: receive windows meet at its multiples, so the fp32
// accumulators it carries between windows continue the one-window K loop exactly.
constexpr int kExpertWgradKRows = MOK_EXPERT_WGRAD_K_ROWS;
// Rows per minibatch of the dispatching GEMM: the unit in which the in-kernel dispatch hands rows
// to the GEMM (a ready counter per minibatch) and in which its ring buffer is reused. Small enough
// that the first tiles wait little (the first minibatch is ~14 MB at H = 7168), large enough that
// a tile rarely spans two.
constexpr int32_t kDispatchMinibatchRows = MOK_DISPATCH_MINIBATCH_ROWS;
// Most minibatches of the dispatching GEMM's ring (the op checks ring_minibatches against it).
constexpr int64_t kMaxDispatchRingMinibatches = MOK_MAX_DISPATCH_RING_MINIBATCHES;
static_assert(kMaxDispatchRingMinibatches * kDispatchMinibatchRows + kExpertGemmTileM < (int64_t(1) << 31),
              "the ring's rows and its mirrored m-tile are 32-bit on the device (mok_params.h DispatchRingParams)");
// Largest topk of the row gather and combine kernels (their per-token tables live in shared memory).
constexpr int64_t kMaxTopk = MOK_MAX_TOPK;
// Every bounded wait of a kernel gives up after this long (common/watchdog_sm90.cuh).
constexpr uint64_t kWaitTimeoutNs = MOK_WAIT_TIMEOUT_NS;
// Most ranks of an expert-parallel group the in-kernel exchange addresses (one NVLink node): the
// kernels take every rank's buffer address by value in their params (mok_params.h, RowSource).
constexpr int kMaxEpRanks = MOK_MAX_EP_RANKS;
// FP8 blockwise (docs/design.md §12): values per scale block along a GEMM's reduction dimension
// (1x128 activations, 128x128 weights); four wgmma k32 E4M3 instructions per block.
constexpr int kFp8Block = MOK_FP8_BLOCK;
// E4M3's largest finite value: a block's amax is scaled to it.
constexpr float kFp8E4m3Max = float(MOK_FP8_E4M3_MAX);
// The GEMM-A scale layout pads its rows to this multiple (16-byte TMA strides).
constexpr int kFp8ScaleRowPad = MOK_FP8_SCALE_ROW_PAD;
static_assert(kFp8Block == 128, "the FP8 recipe's blocks are 128 wide (four k32 wgmma per block)");
static_assert(kMaxEpRanks >= 1 && kMaxEpRanks <= 32, "the exchange's waits give each rank one lane of a warp");
// Phases of the in-kernel exchange's signal protocol: the signal pad's first dimension (common/failure_codes.h
// ExchangePhase names them).
constexpr int kNumExchangePhases = MOK_NUM_EXCHANGE_PHASES;

// The entries of COMPILED this build knows, in the order the compiled_limits ops report them.
#define MOK_COMPILED_LIMITS(X) \
  X(EXPERT_GEMM_TILE_M)          \
  X(EXPERT_GEMM_TILE_N)          \
  X(EXPERT_WGRAD_K_ROWS)         \
  X(DISPATCH_MINIBATCH_ROWS)     \
  X(MAX_DISPATCH_RING_MINIBATCHES) \
  X(MAX_TOPK)                    \
  X(WAIT_TIMEOUT_NS)             \
  X(MAX_EP_RANKS)                \
  X(NUM_EXCHANGE_PHASES)         \
  X(FP8_BLOCK)                   \
  X(FP8_E4M3_MAX)                \
  X(FP8_SCALE_ROW_PAD)
#define MOK_LIMIT_NAME(name) #name,
#define MOK_LIMIT_VALUE(name) int64_t(MOK_##name),
inline constexpr const char* kCompiledLimitNames[] = {MOK_COMPILED_LIMITS(MOK_LIMIT_NAME)};
inline constexpr int64_t kCompiledLimitValues[] = {MOK_COMPILED_LIMITS(MOK_LIMIT_VALUE)};
#undef MOK_LIMIT_NAME
#undef MOK_LIMIT_VALUE
static_assert(sizeof(kCompiledLimitNames) / sizeof(kCompiledLimitNames[0]) ==
                  sizeof(kCompiledLimitValues) / sizeof(kCompiledLimitValues[0]),
              "one value per compiled limit name");

}  // namespace mok
